from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from traintape.schema import (
    SCHEMA_VERSION,
    STAT_NAMES,
    CapturePolicy,
    InvalidNameError,
    Kind,
    Manifest,
    Producer,
    SchemaVersionError,
    TensorSpec,
    check_readable,
    manifest_json_schema_text,
    validate_name,
)

SCHEMA_FILE = Path(__file__).parents[1] / "traintape" / "schema" / "manifest.schema.json"


def test_committed_json_schema_matches_models():
    assert SCHEMA_FILE.read_text() == manifest_json_schema_text(), (
        "traintape/schema/manifest.schema.json drifted from the models: "
        "regenerate with `traintape schema -o traintape/schema/manifest.schema.json`"
    )


def test_cli_prints_schema():
    out = subprocess.run(
        [sys.executable, "-m", "traintape.cli", "schema"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["title"] == "Manifest"


@pytest.mark.parametrize(
    "name", ["dense/kernel", "encoder/layers/3/attn/q/kernel", "a", "x-y_z/0", "layers/10/bias"]
)
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize(
    ("name", "segment"),
    [
        ("", "empty"),
        ("a//b", "segment 1 is empty"),
        ("a/../b", "segment 1 is '..'"),
        ("./a", "segment 0 is '.'"),
        ("a/b.c", "segment 1 'b.c'"),
        ("dense/kernel:0", "segment 1 'kernel:0'"),
        ("/abs", "segment 0 is empty"),
        ("a b/c", "segment 0 'a b'"),
    ],
)
def test_invalid_names_name_the_segment(name, segment):
    with pytest.raises(InvalidNameError, match=segment.replace(".", r"\.").replace("'", "'")):
        validate_name(name)


def test_stat_vector_order_is_fixed():
    assert STAT_NAMES == (
        "mean", "std", "min", "max", "l2", "abs_mean", "zero_frac", "nan_count", "inf_count",
        "sig",
    )  # fmt: skip


def _producer():
    return Producer(traintape_version="0", python_version="3.11")


def test_tensor_spec_checks_permutation_and_role():
    s = TensorSpec(
        name="fc/kernel", kind=Kind.PARAM, role="kernel", layer="fc", dtype="float32",
        shape=[3, 4], source_name="fc.weight", source_shape=[4, 3], permutation=[1, 0],
    )  # fmt: skip
    assert s.numel == 12
    with pytest.raises(ValidationError, match="permuted"):
        TensorSpec(
            name="fc/kernel", kind="param", role="kernel", layer="fc", dtype="float32",
            shape=[3, 4], source_shape=[3, 4], permutation=[1, 0],
        )  # fmt: skip
    with pytest.raises(ValidationError, match="role"):
        TensorSpec(name="fc/kernel", kind="param", role="bias", layer="fc", dtype="f4", shape=[1])
    with pytest.raises(ValidationError, match="segment 1"):
        TensorSpec(
            name="fc/ker.nel", kind="param", role="ker.nel", layer="fc", dtype="f4", shape=[1]
        )


def test_manifest_refuses_unsorted_and_clashing_tensors():
    def spec(n):
        layer, _, role = n.rpartition("/")
        return TensorSpec(name=n, kind="param", role=role, layer=layer, dtype="float32", shape=[1])

    Manifest(run_id="r", producer=_producer(), tensors=[spec("a/b"), spec("a/c")])
    with pytest.raises(ValidationError, match="sorted"):
        Manifest(run_id="r", producer=_producer(), tensors=[spec("a/c"), spec("a/b")])
    with pytest.raises(ValidationError, match="prefix"):
        Manifest(run_id="r", producer=_producer(), tensors=[spec("a/b"), spec("a/b/c")])


def test_schema_version_checks():
    check_readable(SCHEMA_VERSION)
    check_readable("1.7.3")
    with pytest.raises(SchemaVersionError, match=r"2\.0\.0.*reads schema 1\.x"):
        check_readable("2.0.0")


def test_policy_questions():
    p = CapturePolicy(every=2, full_every=10, include=("enc/*",), exclude=("*/bias",))
    assert p.captures(4) and not p.captures(3)
    assert p.is_full(20) and not p.is_full(5)
    assert p.selects("enc/l/kernel") and not p.selects("enc/l/bias") and not p.selects("dec/k")
    assert p.snapshots(10, "grad") and not CapturePolicy().is_full(0)
