"""Canonical names, layouts and weight loading of the PyTorch adapter."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from traintape.adapters.torch.names import model_layout  # noqa: E402
from traintape.torch import from_canonical, to_canonical  # noqa: E402

torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc = nn.Linear(d, d)


class Zoo(nn.Module):
    """ModuleList, Conv2d, BatchNorm2d, Embedding, LayerNorm, MultiheadAttention, LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv2d(3, 4, kernel_size=(3, 2))
        self.bn = nn.BatchNorm2d(4)
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.lstm = nn.LSTM(8, 6, num_layers=2)
        self.head = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))


def test_canonical_names_shapes_and_permutations():
    torch.manual_seed(0)
    m = Zoo()
    layout = model_layout(m)
    by = layout.by_name()
    want = {
        "embed/embedding": ((11, 8), None),
        "conv/kernel": ((3, 2, 3, 4), (2, 3, 1, 0)),
        "conv/bias": ((4,), None),
        "bn/scale": ((4,), None),
        "bn/bias": ((4,), None),
        "bn/running_mean": ((4,), None),
        "bn/running_var": ((4,), None),
        "head/0/kernel": ((6, 5), (1, 0)),
        "head/2/bias": ((2,), None),
        "lstm/0/kernel_ih": ((8, 24), (1, 0)),
        "lstm/0/kernel_hh": ((6, 24), (1, 0)),
        "lstm/1/kernel_ih": ((6, 24), (1, 0)),
        "lstm/1/bias_hh": ((24,), None),
        "head/0/bias": ((5,), None),
        "head/2/kernel": ((5, 2), (1, 0)),
        "lstm/0/bias_ih": ((24,), None),
        "lstm/0/bias_hh": ((24,), None),
        "lstm/1/kernel_hh": ((6, 24), (1, 0)),
        "lstm/1/bias_ih": ((24,), None),
    }
    for i in range(2):
        p = f"blocks/{i}"
        want[f"{p}/norm/scale"] = ((8,), None)
        want[f"{p}/norm/bias"] = ((8,), None)
        want[f"{p}/fc/kernel"] = ((8, 8), (1, 0))
        want[f"{p}/fc/bias"] = ((8,), None)
        for proj in "qkvo":
            want[f"{p}/attn/{proj}/kernel"] = ((8, 8), (1, 0))
            want[f"{p}/attn/{proj}/bias"] = ((8,), None)
    for name, (shape, perm) in want.items():
        assert by[name].shape == shape, name
        assert by[name].permutation == perm, name
    assert not any("num_batches_tracked" in n for n in by)
    assert not any("weight" in n or "out_proj" in n or "in_proj" in n for n in by)
    assert sorted(by) == sorted(want)
    assert by["blocks/1/attn/k/kernel"].source_name == "blocks.1.attn.in_proj_weight[8:16]"
    assert by["blocks/1/attn/k/kernel"].source_shape == (8, 8)
    assert by["bn/running_var"].is_buffer and not by["bn/running_var"].trainable
    sites = {s.name: s.layer_kind for s in layout.activations}
    assert sites["conv/output"] == "conv"
    assert sites["blocks/0/attn/output"] == "attention"
    assert sites["lstm/output"] == "lstm"
    assert "head/1/output" not in sites  # ReLU has no parameters
    # canonical values: row blocks of in_proj_weight, transposed; conv kernel-last
    can = to_canonical(m)
    attn = m.blocks[1].attn
    np.testing.assert_array_equal(
        can["blocks/1/attn/v/kernel"], attn.in_proj_weight[16:].T.detach()
    )
    np.testing.assert_array_equal(can["blocks/1/attn/o/kernel"], attn.out_proj.weight.T.detach())
    np.testing.assert_array_equal(can["conv/kernel"], m.conv.weight.permute(2, 3, 1, 0).detach())
    np.testing.assert_array_equal(can["lstm/1/kernel_hh"], m.lstm.weight_hh_l1.T.detach())


def test_from_canonical_round_trip_is_exact():
    torch.manual_seed(1)
    src, dst = Zoo(), Zoo()
    canon = to_canonical(src)
    from_canonical(dst, canon)
    for (n1, a), (n2, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert n1 == n2
        if n1.endswith("num_batches_tracked"):
            continue
        assert torch.equal(a, b), n1
    rng = np.random.default_rng(0)
    fresh = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in canon.items()}
    from_canonical(dst, fresh)
    back = to_canonical(dst)
    assert back.keys() == fresh.keys()
    for k in fresh:
        np.testing.assert_array_equal(back[k], fresh[k])


def test_from_canonical_refuses_unknown_missing_and_bad_shapes():
    m = nn.Sequential(nn.Linear(3, 2))
    canon = to_canonical(m)
    with pytest.raises(KeyError, match="missing tensors"):
        from_canonical(m, {"0/kernel": canon["0/kernel"]})
    with pytest.raises(KeyError, match="unknown tensors"):
        from_canonical(m, {**canon, "0/extra": np.zeros(1)})
    with pytest.raises(ValueError, match="canonical shape"):
        from_canonical(m, {**canon, "0/kernel": np.zeros((2, 3), np.float32)})
    from_canonical(m, {"0/bias": np.ones(2, np.float32)}, strict=False)
    assert torch.equal(m[0].bias.detach(), torch.ones(2))


def test_tied_parameters_recorded_once_with_alias():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.proj = nn.Linear(4, 4)
            self.lm_head = nn.Linear(4, 7, bias=False)
            self.lm_head.weight = self.embed.weight

    by = model_layout(Tied()).by_name()
    assert "lm_head/kernel" not in by
    assert by["embed/embedding"].aliases == ["lm_head/kernel"]


def test_unknown_module_warns_with_type_and_uses_generic_names():
    class Scaler(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    m = nn.Sequential(nn.Linear(3, 3), Scaler())
    with pytest.warns(UserWarning, match="Scaler"):
        by = model_layout(m).by_name()
    assert by["1/gain"].layer_kind is None and by["1/gain"].permutation is None


def test_name_map_and_bidirectional_gru():
    m = nn.DataParallel(nn.Sequential(nn.GRU(3, 4, bidirectional=True)))  # wrapper stripped
    by = model_layout(m, name_map={"0/kernel_ih": "enc/kernel_ih"}).by_name()
    assert "enc/kernel_ih" in by
    assert by["0/reverse/kernel_hh"].shape == (4, 12)
    assert by["0/reverse/kernel_hh"].source_name == "0.weight_hh_l0_reverse"
