"""traintape.torch.watch under torch.compile (CPU): same stats as eager.

``fullgraph=True`` proves the forward hooks cause no graph break.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import traintape  # noqa: E402
from traintape import CapturePolicy, Recorder  # noqa: E402
from traintape.torch import watch  # noqa: E402

torch.set_num_threads(1)
KINDS = ("param", "grad", "update", "activation")


def train(url: str, backend: str | None) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(url, CapturePolicy(every=1))
    with rec, watch(model, rec, optimizer=opt):
        fm = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
        for i in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            fm(x).pow(2).mean().backward()
            opt.step()
    run = traintape.open_run(url)
    assert run.tensor_names("activation") == ["0/output", "2/output"]
    return {k: run.stats_array(k) for k in KINDS}


def check(backend: str, mem_url: str) -> None:
    torch._dynamo.reset()
    eager = train(mem_url + "-eager", None)
    compiled = train(mem_url + "-compiled", backend)
    for k in KINDS:
        np.testing.assert_allclose(compiled[k], eager[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_compile_aot_eager_backend_records_same_stats(mem_url):
    check("aot_eager", mem_url)


def test_compiled_wrapper_is_refused_with_a_clear_message(mem_url):
    compiled = torch.compile(nn.Linear(2, 2), backend="aot_eager")
    with Recorder(mem_url) as rec, pytest.raises(TypeError, match=r"watch.*first.*torch.compile"):
        watch(compiled, rec)


def test_removed_hooks_are_inert_in_graphs_compiled_while_watching(mem_url):
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 3))
    rec = Recorder(mem_url)
    h = watch(model, rec)
    fm = torch.compile(model, backend="aot_eager")
    fm(torch.randn(2, 4)).sum().backward()
    h.step()
    h.remove()
    for _ in range(3):
        fm(torch.randn(2, 4)).sum().backward()
    assert h._act_stash == [] and h._act_raw == {}
    rec.close()


@pytest.mark.slow
def test_compile_inductor_records_same_stats(mem_url):
    check("inductor", mem_url)  # ~60 s on a shared 2-core CPU (C++ codegen)
