"""What a calibration does not cover for one deployment: the caveat lines every run prints.

A run is priced by measured curves where the calibration has them and by first-principles models elsewhere. The
simulator must say which parts of *this* deployment fall in the second group — a GEMM format or an expert layout
the tables never measured, an all-reduce over more ranks than were measured, an EP size beyond the all-to-all
table — and, where it extrapolates along a measured grid, by how much. :func:`calibration_caveats` checks the
quantities that the step cost model (``sim.costs.step``) prices for the scenario's prefill and decode plans and
returns one line per gap (an empty list: everything measured).
"""

from __future__ import annotations

from rackbed.sim.costs import constants as C

UNCALIBRATED_BLACKWELL = ("Blackwell figures extrapolate: GPU rates and NVLink/NVLS parameters come from datasheets "
                          "and NCCL's tuning tables, not from measurements (see calibration/README.md)")


def _meta(calib) -> dict:
    return getattr(calib, "meta", None) or {}


def _gemm_gap(calib, gpu: str, fmt: str, n: int, k: int, what: str) -> str | None:
    e = calib.entry("gemm_tflops", gpu, fmt=fmt, n=n, k=k)
    if e is None or "fmt" not in e.key:
        return f"{what} GEMMs in {fmt}: not measured in this format, first-principles roofline"
    where = calib.grid_position("gemm_tflops", gpu, fmt=fmt, n=n, k=k)
    if where and "outside" in where:
        return f"{what} GEMM ({n}x{k}, {fmt}): {where}"
    return None


def _moe_gap(calib, gpu: str, model, fmt: str, tp: int, ep: int, role: str) -> str | None:
    from rackbed.sim.costs.moe_block import moe_key

    key = moe_key(model, fmt, tp, ep)
    if calib.entry("moe_us", gpu, **key) is None:
        measured = any(e.kind == "moe_us" for e in calib.entries)
        if not measured:
            return None  # a calibration without MoE blocks prices the grouped GEMMs (kind gemm_tflops)
        return (f"{role} MoE block ({model.hidden}/{model.moe_intermediate}, top-{model.top_k} of {model.n_experts}, "
                f"{fmt}, TP{tp} EP{ep}): not measured, grouped-GEMM model without measured fixed costs")
    where = calib.grid_position("moe_us", gpu, **key)
    if where:
        return f"{role} MoE block: {where} of the measured EP sizes"
    return None


def _allreduce_gap(calib, gpu: str, n_ranks: int, what: str, one_domain: bool = True) -> str | None:
    if n_ranks < 2:
        return None
    if not one_domain and any(e.kind == "allreduce_us" and e.gpu == gpu for e in calib.entries):
        return f"{what} all-reduce over {n_ranks} GPUs spans NVLink domains: first-principles network model"
    algos = sorted({e.key.get("algo") for e in calib.entries
                    if e.kind == "allreduce_us" and e.gpu == gpu and e.key.get("n_ranks") == n_ranks})
    if not algos:
        have = sorted({e.key.get("n_ranks") for e in calib.entries if e.kind == "allreduce_us" and e.gpu == gpu})
        if not have:
            return None
        return (f"{what} all-reduce over {n_ranks} GPUs: measured only at {', '.join(map(str, have))} GPUs, "
                f"first-principles estimate")
    return None


def _a2a_gap(calib, gpu: str, ep: int, model, one_domain: bool = True) -> str | None:
    if ep < 2 or not any(e.kind == "a2a_us" and e.gpu == gpu for e in calib.entries):
        return None
    if not one_domain:
        return (f"decode dispatch/combine (EP{ep}) spans NVLink domains: the tables were measured inside one, "
                f"first-principles network model (DeepEP low-latency mode over the NICs)")
    where = calib.grid_position("a2a_us", gpu, op="dispatch", n_ranks=ep, payload="bf16")
    out = []
    if where:
        out.append(where)
    hid = [n for n in _meta(calib).get("notes", []) if n.startswith("all-to-all measured")]
    if hid and f"hidden {model.hidden}" not in hid[0] and f", {model.hidden}" not in hid[0]:
        out.append(f"measured at another hidden size, priced for {model.hidden} at equal bytes")
    return f"decode dispatch/combine (EP{ep}): {'; '.join(out)}" if out else None


def calibration_caveats(calib, topo, model, prefill_plan, decode_plan) -> list[str]:
    """One line per part of this deployment that the calibration ``calib`` (None: uncalibrated) does not price
    from measurements, or prices by extrapolating along a measured grid (module docstring); first, when the
    weight format has no tensor cores on the GPU (NVFP4 / MX formats on Hopper), how it is emulated."""
    from rackbed.sim.costs.gemm import format_execution

    fe = format_execution(topo.gpu_spec(prefill_plan.gpus[0]), prefill_plan.weight_format)
    emulated = [] if fe.note == "native" else [fe.note]
    return emulated + _calibration_gaps(calib, topo, model, prefill_plan, decode_plan)


def _calibration_gaps(calib, topo, model, prefill_plan, decode_plan) -> list[str]:
    """The calibration part of :func:`calibration_caveats`."""
    gpu = topo.gpu_spec(prefill_plan.gpus[0])
    if calib is None:
        return [UNCALIBRATED_BLACKWELL] if gpu.arch == "blackwell" else []
    name = gpu.name
    fmt = prefill_plan.weight_format
    out: list[str] = []
    if not any(e.gpu == name for e in calib.entries):
        return [f"the calibration has no curves for {name}: first-principles cost models"]
    tp = prefill_plan.tp
    mla = model.mixer("mla")
    if mla is not None:  # MLA: its widest projection from the hidden state (q_a, or q without a q LoRA)
        q_n, q_k = mla.proj_gemms(tp)[0]
    else:
        att = model.mixer("full")
        q_n = (att.n_q_heads * att.head_dim) // tp + 2 * att.kv_units_per_rank(tp) * att.head_dim
        q_k = model.hidden
    for what, n, k in (("attention projection", q_n, q_k), ("LM head", model.vocab, model.hidden)):
        gap = _gemm_gap(calib, name, fmt if what != "LM head" else "bf16", n, k, what)
        if gap:
            out.append(gap)
    out += _mixer_gaps(calib, name, model)
    if model.n_experts:
        for role, plan in (("prefill", prefill_plan), ("decode", decode_plan)):
            ep, red = plan.ep, getattr(plan, "redundant_experts", 0)
            if red:  # a rank of s slots is priced as the table's rank of s experts (sim.costs.step._routed_block_s)
                per_rank = (model.n_experts + red) // ep
                ep = model.n_experts // per_rank if model.n_experts % per_rank == 0 else ep
            gap = _moe_gap(calib, name, model, fmt, plan.expert_tp, ep, role)
            if gap and red:
                gap += f" ({plan.ep} ranks of {(model.n_experts + red) // plan.ep} slots, {red} redundant)"
            if gap and gap not in out:
                out.append(gap)
    from rackbed.sim.costs.collective import group_links

    ar = [("prefill TP", prefill_plan.tp, prefill_plan.tp_group(0))]
    if prefill_plan.dp == 1:
        ar.append(("prefill EP combine", prefill_plan.ep, prefill_plan.gpus))
    else:  # DP attention (a prefiller spanning nodes): DeepEP normal mode, no EP all-reduce
        out.append(f"prefill dispatch/combine (EP{prefill_plan.ep}, DP attention over "
                   f"{group_links(topo, prefill_plan.gpus).n_domains} NVLink domains): first-principles DeepEP "
                   "normal-mode model over the NICs")
    for what, n, gpus in ar:
        gap = _allreduce_gap(calib, name, n, what, group_links(topo, gpus).one_domain)
        if gap and gap not in out:
            out.append(gap)
    if getattr(decode_plan, "ep", 1) > 1:
        from rackbed.sim.costs.collective import group_links

        gap = _a2a_gap(calib, name, decode_plan.ep, model, group_links(topo, decode_plan.gpus).one_domain)
        if gap:
            out.append(gap)
    if any(e.kind in ("allreduce_us",) for e in calib.entries) and gpu.arch == "blackwell" and not any(
            e.kind == "allreduce_us" and e.key.get("algo") == "nvls" for e in calib.entries):
        out.append("NVLS (NVLink SHARP) all-reduce is not in the tables: its estimate is first-principles")
    if _meta(calib).get("source") == "aiconfigurator-core":
        notes = _meta(calib).get("notes", [])
        if getattr(decode_plan, "kv_dtype", "bf16") == "fp8" and not _has_fp8_decode(calib, name):
            fp8 = [n for n in notes if n.startswith("decode attention with an fp8 KV cache")]
            out.append("decode attention with an fp8 KV cache: the tables' bf16-KV curves at 1 B per element"
                       + (f" ({fp8[0].split('within ')[-1]} off the fp8 rows)" if fp8 else ""))
        multi = [n for n in notes if n.startswith(PER_SEQUENCE_PREFILL_NOTE)]
        if multi:
            out.append(multi[0])
        out.append(f"per-step framework overhead is not in the tables: {C.HOST_STEP_US:g} µs per step assumed")
    return out


#: how a calibration imported with batch-1 prefill curves only says so (its batched prefills are priced per
#: sequence); calibrations that import the batched rows (``sim.perf_tables_attention``) carry no such note
PER_SEQUENCE_PREFILL_NOTE = "prefill attention: batches of"


def _has_fp8_decode(calib, gpu: str) -> bool:
    """Whether ``calib`` has decode-attention curves of fp8 KV caches (key ``kv``) for ``gpu``."""
    return any(e.kind == "decode_attn_GBps" and e.gpu == gpu and e.key.get("kv") == "fp8" for e in calib.entries)


def _mixer_gaps(calib, gpu: str, model) -> list[str]:
    """Token-mixer kinds beyond GQA that the calibration has no curves for (their cores run on the roofline)."""
    out = []
    att = model.mixer("sliding")
    if att is not None and not any(e.gpu == gpu and e.key.get("window") == att.window for e in calib.entries):
        out.append(f"sliding-window attention (window {att.window}): not in the tables, priced at the rate of a "
                   f"causal sequence of 2 x window tokens (prefill) and the decode bandwidth roofline")
    mla = model.mixer("mla")
    if mla is not None:
        from rackbed.sim.costs.mla import mla_dims

        dims = mla_dims(mla)
        for kind in ("mla_prefill_tflops", "mla_decode_GBps", "mla_bmm_us"):
            if not any(e.gpu == gpu and e.kind == kind and e.key.get("dims") == dims for e in calib.entries):
                out.append(f"MLA ({dims}): no {kind} curves for these dims, first-principles roofline")
    return out

