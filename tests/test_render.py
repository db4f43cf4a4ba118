import json
from pathlib import Path

from mokgen.codegen import TEMPLATE_DIR, render
from mokgen.codegen.render import GEMM_PARTS
from mokgen.ir import DEFAULT_PRESET, PRESETS, MoESpec
from mokgen.schedule import make_plan

ROOT = Path(__file__).resolve().parents[1]


def test_render_is_byte_for_byte_reproducible():
    for spec in PRESETS.values():
        assert render(make_plan(spec)) == render(make_plan(spec))


def test_committed_default_variant_equals_a_fresh_render():
    from mokgen.codegen.build import resolve_plan

    spec = PRESETS[DEFAULT_PRESET]
    files = render(resolve_plan(spec, ROOT / "generated"))
    committed = ROOT / "generated" / spec.variant
    for rel, text in files.items():
        assert (committed / rel).read_text() == text, f"generated/{spec.variant}/{rel} is stale: run `mokgen build`"


def test_rendered_modules_are_python_and_manifest_is_complete():
    spec = MoESpec(experts=16, topk=4, hidden=1024, intermediate=512, shared_intermediate=768)
    plan = make_plan(spec)
    files = render(plan)
    forward = {"route.py", "route_backward.py", "dispatch.py", "gemm_gateup.py", "gemm_down.py", "shared_gateup.py", "shared_down.py",
               "gemm_fused.py", "gemm_fused_routed.py", "combine.py", "status_mirror.py", "launch.c", "manifest.json"}
    training = {f"{k}.py" for k in ("gemm_gateup_train", "shared_gateup_train", "bwd_recompute", "bwd_dgrad_down",
                                    "bwd_swiglu", "bwd_dgrad_gateup", "bwd_shared_recompute", "bwd_shared_dgrad_down",
                                    "bwd_shared_swiglu", "bwd_shared_dgrad_gateup", "bwd_combine", "wgrad_down",
                                    "wgrad_gate", "wgrad_up", "wgrad_shared_down", "wgrad_shared_gate",
                                    "wgrad_shared_up")}
    assert forward | training == set(files)
    for rel, text in files.items():
        if rel.endswith(".py"):
            compile(text, rel, "exec")
    m = json.loads(files["manifest.json"])
    assert m["spec"] == spec.to_dict()
    # The templates this Plan renders (their hashes decide when a build is stale).
    # (and the templates those include: dispatch's phases and its chunks', which the dispatch kernels and the
    # fused launch run, route's phases, and the combine's piece, which the combine kernels and the fused
    # launch's combine phase sum with, and the error code's copy to the host, which the kernels that end an
    # entry render, and the grouped GEMM's parts)
    assert set(m["templates"]) == {k.template for k in plan.kernels} | {"launch.c.j2", "dispatch_phases.py.j2",
                                                                        "dispatch_chunks.py.j2", "route_phases.py.j2",
                                                                        "combine_piece.py.j2", "status_copy.py.j2",
                                                                        *GEMM_PARTS}
    assert set(m["templates"]) <= {p.name for p in TEMPLATE_DIR.glob("*.j2")}
    assert m["cute_dsl_version"] == "4.8.1" and m["plan"]["variant"] == spec.variant


def test_templates_take_their_numbers_from_the_plan():
    """Tile sizes in the rendered GEMM are the Plan's, so changing the Plan changes the code."""
    plan = make_plan(PRESETS["olmoe"])
    k = plan.kernel("gemm_down")
    text = render(plan)["gemm_down.py"]
    assert f"TILE_MNK = ({k.params['tile_m']}, {k.params['tile_n']}, {k.params['tile_k']})" in text
    assert f"STAGES = {k.params['stages']}" in text
    k.params["stages"] = 3
    assert "STAGES = 3" in render(plan)["gemm_down.py"]


def test_the_grouped_gemm_parts_are_what_its_template_includes():
    """GEMM_PARTS (whose hashes the manifest records) names exactly the parts that
    grouped_gemm_persistent.py.j2 includes beside the shared pieces other templates include
    too, and each part says at its top which file it is part of."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)))
    parent = "grouped_gemm_persistent.py.j2"
    named = set(meta.find_referenced_templates(env.parse((TEMPLATE_DIR / parent).read_text())))
    shared = {"bounded_wait.py.j2", "task_record.py.j2", "combine_piece.py.j2", "status_copy.py.j2"}
    assert named - shared == set(GEMM_PARTS)
    for part in GEMM_PARTS:
        assert (TEMPLATE_DIR / part).read_text().lstrip("{#- ").startswith("Part of " + parent)
