"""Property-based tests over MoESpec (hypothesis): every legal spec within the hardware limits
plans and renders to valid Python, and every illegal one is refused with a one-line reason,
by the API and by the CLI (exit code 2). No GPU, no compiler."""
import json

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mokgen.cli import main
from mokgen.codegen.render import render
from mokgen.ir import MoESpec, SpecError
from mokgen.ir.spec import MAX_EXPERTS, MAX_SIZE, MAX_TOPK, SIZE_MULTIPLE
from mokgen.schedule.plan import make_plan

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def legal_specs(draw):
    """Sizes as users write them: any multiple of 64 (not only powers of two), K from 1 to E,
    E from 1, with and without a shared expert."""
    experts = draw(st.one_of(st.integers(1, 8), st.integers(1, 512)))
    topk = draw(st.one_of(st.just(1), st.just(min(experts, MAX_TOPK)), st.integers(1, min(experts, 16))))
    size = st.integers(1, 128).map(lambda n: SIZE_MULTIPLE * n)  # 64 .. 8192
    return MoESpec(experts=experts, topk=topk, hidden=draw(size), intermediate=draw(size),
                   shared_intermediate=draw(st.one_of(st.just(0), size)), renormalize=draw(st.booleans()))


def check_plan(spec: MoESpec):
    plan = make_plan(spec)
    names = {k.name for k in plan.kernels}
    for entry, steps in plan.steps.items():
        assert steps and set(steps) <= names, (entry, steps)
    for T in (0, 1, 7, 4096):  # every buffer has a size for any T, and T=0 allocates nothing odd
        for b in plan.buffers:
            for d in b.shape:
                assert int(sympy.sympify(d).subs("T", T)) >= 0, (b.name, d, T)
    files = render(plan)
    for rel, text in files.items():
        if rel.endswith(".py"):
            compile(text, rel, "exec")
    assert json.loads(files["manifest.json"])["spec"] == spec.to_dict()
    return plan


@settings(max_examples=150, **SETTINGS)
@given(legal_specs())
def test_every_legal_spec_plans_and_renders(spec):
    plan = check_plan(spec)
    # The fused launch is built exactly when its tile shapes divide the layer's sizes.
    tn = plan.kernel("gemm_gateup").params["tile_n"]
    fusable = spec.hidden % (2 * tn) == 0 and spec.intermediate % tn == 0 and spec.shared_intermediate % tn == 0
    assert ("forward_fused" in plan.steps) == fusable


@pytest.mark.parametrize("spec", [
    MoESpec(experts=1, topk=1, hidden=64, intermediate=64),  # E=1, K=1, the smallest sizes
    MoESpec(experts=7, topk=7, hidden=192, intermediate=320, shared_intermediate=64),  # K=E, odd multiples
    MoESpec(experts=MAX_EXPERTS, topk=MAX_TOPK, hidden=64, intermediate=64),  # the largest E and K
    MoESpec(experts=8, topk=2, hidden=MAX_SIZE, intermediate=MAX_SIZE),  # the largest sizes
])
def test_edge_specs_plan_and_render(spec):
    check_plan(spec)


# One field made illegal at a time, on top of a legal spec: (field, strategy of bad values).
BAD_FIELDS = {
    "experts": st.one_of(st.integers(max_value=0), st.integers(MAX_EXPERTS + 1, 10**9), st.just(True), st.floats()),
    "topk": st.one_of(st.integers(max_value=0), st.integers(MAX_TOPK + 1, 10**6)),
    "hidden": st.one_of(st.integers(max_value=SIZE_MULTIPLE - 1), st.integers(MAX_SIZE + 1, 10**9),
                        st.integers(SIZE_MULTIPLE, MAX_SIZE).filter(lambda v: v % SIZE_MULTIPLE)),
    "intermediate": st.one_of(st.integers(max_value=SIZE_MULTIPLE - 1),
                              st.integers(SIZE_MULTIPLE, MAX_SIZE).filter(lambda v: v % SIZE_MULTIPLE)),
    "shared_intermediate": st.one_of(st.integers(max_value=-1),
                                     st.integers(1, MAX_SIZE).filter(lambda v: v % SIZE_MULTIPLE)),
    "dtype": st.text(max_size=8).filter(lambda v: v != "bf16"),
    "renormalize": st.one_of(st.integers(), st.text(max_size=4)),
}


@settings(max_examples=200, **SETTINGS)
@given(st.sampled_from(sorted(BAD_FIELDS)).flatmap(lambda f: st.tuples(st.just(f), BAD_FIELDS[f])))
def test_every_illegal_spec_is_refused_in_one_line(bad):
    field, value = bad
    kw = dict(experts=64, topk=8, hidden=2048, intermediate=1024)
    kw[field] = value
    with pytest.raises(SpecError) as e:
        MoESpec(**kw)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300
    assert field.split("_")[0] in msg or "topk" in msg, msg  # it names what is wrong


FLAGS = {"experts": "--experts", "topk": "--topk", "hidden": "--hidden", "intermediate": "--intermediate",
         "shared_intermediate": "--shared-intermediate"}


@settings(max_examples=40, **SETTINGS)
@given(st.sampled_from(sorted(FLAGS)).flatmap(
    lambda f: st.tuples(st.just(f), st.integers(-(10**6), 10**6).filter(lambda v: _illegal(f, v)))))
def test_cli_refuses_illegal_specs_with_exit_code_2(tmp_path_factory, bad):
    from click.testing import CliRunner

    field, value = bad
    out = tmp_path_factory.mktemp("out")
    r = CliRunner().invoke(main, ["build", FLAGS[field], str(value), "--out", str(out), "--no-compile"])
    assert r.exit_code == 2, (bad, r.output)
    assert not any(out.iterdir()), "nothing is written for an illegal spec"


def _illegal(field, value) -> bool:
    kw = dict(experts=64, topk=8, hidden=2048, intermediate=1024)
    kw[field] = value
    try:
        MoESpec(**kw)
    except SpecError:
        return True
    return False
