"""The planted bugs of the compare corpus: one-line mistakes people make when porting a
model between frameworks or writing its training loop.

Each :class:`Bug` is planted in one port (``side``: the torch port, or the JAX port for
the recurrent gate mistakes) and compared against the *correct* port in the other
framework, with the same recipe and dtype. It declares where compare's first divergence
must be: the kind, the tensor (``fnmatch`` patterns over canonical names: the layer the
mistake is in, or for a mistake that has no layer of its own the first recorded tensor
it reaches) and the step.

Where data flows within a step decides the expected tensor:

- a mistake in a layer's forward computation shows first as an ``activation`` of that
  layer (or of the first recorded layer after it) at step 0, before any grad;
- a mistake in the loss leaves the forward pass and params intact and shows first in
  the grads; gradients flow backward from the loss, so the first grad to differ is the
  one nearest the loss (the head) — every grad of the step differs;
- an optimizer mistake leaves param, activation and grad of the step intact and shows
  in ``update`` — on the tensors it concerns (weight decay on norms), or on every tensor
  (``*``) when it scales the whole step;
- a mistake in the initial weights shows in ``param`` at step 0; one in the BatchNorm
  running statistics (not used by the training forward pass) in ``param`` at step 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    arch: str
    recipe: str
    what: str
    kind: str
    where: tuple[str, ...]
    step: int = 0
    side: str = "torch"
    dtype: str = "float32"
    micro_batches: int = 1
    flag: str = ""
    """The bug's name in the port's code (default: ``name``)."""

    @property
    def planted(self) -> str:
        return self.flag or self.name

    @property
    def expected(self) -> str:
        return f"differs: {self.kind} {'|'.join(self.where)} @{self.step}"


BUGS: tuple[Bug, ...] = (
    Bug("no_causal_mask", "gpt", "sgd", "causal mask missing in the attention",
        "activation", ("blocks/0/attn/*",)),
    Bug("attn_scale_1_over_d", "gpt", "sgd", "attention logits scaled by 1/d, not 1/sqrt(d_head)",
        "activation", ("blocks/0/attn/*",)),
    Bug("gelu_tanh", "gpt", "sgd", "tanh-approximate GELU where the original uses erf",
        "activation", ("blocks/0/mlp/*",)),
    Bug("transposed_q_kernel", "gpt", "sgd",
        "square q kernel copied by hand without transposing (W, not W.T)",
        "param", ("blocks/0/attn/q/kernel",)),
    Bug("ln_eps_1e-6", "gpt", "sgd", "LayerNorm eps 1e-6 instead of 1e-5 (first block's ln1)",
        "activation", ("blocks/0/ln1/*",)),
    Bug("init_scale_x2", "gpt", "sgd", "one kernel initialised at twice the scale",
        "param", ("blocks/0/mlp/fc/kernel",)),
    Bug("labels_not_shifted", "gpt", "sgd", "next-token labels not shifted (logits[t] vs token t)",
        "grad", ("head/*",)),
    Bug("wd_on_biases_and_norms_gpt", "gpt", "adamw",
        "AdamW weight decay applied to biases and LayerNorm scales too",
        "update", ("*/bias", "*ln*/scale"), flag="wd_on_norms_and_biases"),
    Bug("tie_lost", "gpt_tied", "sgd", "head copied from the token embedding instead of tied",
        "grad", ("wte/*",)),
    Bug("wd_on_norms_and_biases", "llama", "adamw",
        "AdamW weight decay applied to the RMSNorm scales too (no-decay group forgotten)",
        "update", ("*norm/scale",)),
    Bug("rms_eps_1e-5", "llama", "adamw", "RMSNorm eps 1e-5 instead of 1e-6 (first block)",
        "activation", ("layers/0/attn_norm/*",)),
    Bug("rope_interleaved", "llama", "adamw",
        "rotary embedding on interleaved pairs (GPT-J) instead of halves (rotate_half)",
        "activation", ("layers/0/attn/*",)),
    Bug("schedule_off_by_one", "llama", "adamw",
        "scheduler.step() before optimizer.step(): the schedule runs one step ahead",
        "update", ("*",)),
    Bug("softmax_wrong_axis", "bert", "sgd", "attention softmax over the query axis",
        "activation", ("blocks/0/attn/*",)),
    Bug("post_ln_as_pre_ln", "bert", "sgd", "post-LN block written as pre-LN (first sublayer)",
        "activation", ("blocks/0/*",)),
    Bug("label_smoothing", "vit", "adamw", "label smoothing 0.1 left in the loss",
        "grad", ("head/*",)),
    Bug("bn_momentum_flax", "resnet", "sgd",
        "BatchNorm momentum 0.9 copied from Flax (torch's momentum is 1 - Flax's)",
        "param", ("*running_*",), step=1),
    Bug("bias_missing", "conv1d", "sgd", "second convolution built with bias=False",
        "activation", ("conv2/*",)),
    Bug("grad_accum_sum", "conv1d", "sgd",
        "gradient accumulation over 2 micro-batches sums the losses instead of averaging",
        "grad", ("head/*",), micro_batches=2),
    Bug("nesterov", "mlp", "sgd", "Nesterov momentum where the original uses plain momentum",
        "update", ("*",)),
    Bug("dropout_left_on", "mlp", "sgd", "dropout 0.1 left on (the original trains with 0)",
        "activation", ("fc2/*",)),
    Bug("double_softmax", "mlp", "adam", "softmax applied before cross_entropy (twice)",
        "grad", ("head/*",)),
    Bug("clip_threshold_1", "mlp", "sgd_clip", "gradient clipping at 1.0 where the original clips at 0.5",
        "update", ("*",)),
    Bug("moe_gates_not_renormalised", "moe", "adam",
        "top-2 gates not renormalised over the chosen experts",
        "activation", ("head/*",)),
    Bug("lstm_gate_order_ifog", "lstm", "adam",
        "JAX LSTM splits the gates in Keras order (i, f, o, g) over torch's weights",
        "activation", ("lstm/*",), side="jax"),
    Bug("gru_reset_before_matmul", "gru", "sgd",
        "JAX GRU applies the reset gate before the hidden matmul (Keras reset_after=False)",
        "activation", ("gru/*",), side="jax"),
)  # fmt: skip

QUICK_BUGS = ("no_causal_mask", "transposed_q_kernel", "labels_not_shifted",
              "wd_on_norms_and_biases", "lstm_gate_order_ifog", "nesterov", "dropout_left_on")  # fmt: skip
