import dataclasses
import json

import pytest

from mokgen.ir import PRESETS, MoESpec, SpecError


def base(**kw):
    d = dict(experts=64, topk=8, hidden=2048, intermediate=1024)
    d.update(kw)
    return MoESpec(**d)


@pytest.mark.parametrize("kw,msg", [
    (dict(topk=65), "topk must be in"),
    (dict(experts=4, topk=8), "topk=8 exceeds experts=4"),
    (dict(experts=0), "experts must be in"),
    (dict(topk=0), "topk must be in"),
    (dict(hidden=1000), "hidden=1000 is not a multiple of 64"),
    (dict(intermediate=32), "intermediate must be in"),
    (dict(intermediate=1000), "intermediate=1000 is not a multiple of 64"),
    (dict(shared_intermediate=100), "shared_intermediate=100 is not a multiple of 64"),
    (dict(dtype="fp16"), "unknown dtype 'fp16'"),
    (dict(arch="sm_100a"), "unknown or unsupported arch"),
    (dict(topology="pcie", world_size=2), "unknown topology"),
    (dict(world_size=3, topology="nvlink"), "not divisible by world_size=3"),
    (dict(world_size=2), "needs a multi-GPU topology"),
    (dict(topology="nvlink"), "needs world_size > 1"),
    (dict(hidden=2048.0), "hidden must be an integer"),
    (dict(experts=True), "experts must be an integer"),
    (dict(renormalize="yes"), "renormalize must be true or false"),
])
def test_illegal_specs_have_one_line_messages(kw, msg):
    with pytest.raises(SpecError, match=msg) as e:
        base(**kw)
    assert "\n" not in str(e.value)


def test_presets_are_legal_and_named():
    for name, spec in PRESETS.items():
        assert spec.variant.startswith(f"e{spec.experts}_k{spec.topk}_h{spec.hidden}_i{spec.intermediate}")
    assert PRESETS["olmoe"].variant == "e64_k8_h2048_i1024_bf16_sm90a"
    assert PRESETS["deepseek-v3"].shared_intermediate == 2048


def test_json_round_trip_and_unknown_fields():
    s = base(shared_intermediate=512, renormalize=True)
    assert MoESpec.from_dict(json.loads(s.to_json())) == s
    with pytest.raises(SpecError, match="unknown spec field"):
        MoESpec.from_dict({**s.to_dict(), "bogus": 1})


def test_variant_names_distinguish_every_code_changing_field():
    s = base()
    others = [dataclasses.replace(s, **kw) for kw in (
        dict(experts=32), dict(topk=4), dict(hidden=1024), dict(intermediate=512), dict(shared_intermediate=64),
        dict(renormalize=True), dict(world_size=2, topology="nvlink"))]
    names = {s.variant} | {o.variant for o in others}
    assert len(names) == len(others) + 1
    assert all(n.isidentifier() for n in names)
