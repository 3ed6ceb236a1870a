"""Two views of a Plan: text tables shaped like the lecture's, and JSON with the unit in every key.

`--explain` prints, under each table, the terms behind each number (Q.explain()), so a user can see
which input to calibrate: "expert optimizer = 4.375e9 params x 12 B / expert-DP 5 = 10.50 GB".
"""

from __future__ import annotations

import io
import json
import re
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from rlslurm.network import network_env
from rlslurm.plan.checkpoint_interval import young_interval_s
from rlslurm.plan.quantity import Q, num, params
from rlslurm.plan.report import Plan, preflight, timeouts

if TYPE_CHECKING:
    from rlslurm.plan.options import Option

WIDTH = 132


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


def _memory_table(plan: Plan) -> Table:
    hbm = plan.job.hardware.gpu_mem_gb
    table = _table(f"Trainer memory per GPU for each split ({hbm:g} GB per GPU)",
                   ["rollout nodes", "training GPUs", "DP", "expert DP", "expert opt", "resident", "peak",
                    "headroom", "step", "verdict"])
    for s in plan.splits:
        mem = s.memory
        if mem is None:
            cells = ["-"] * 6
        else:
            cells = [str(mem.dp), f"{mem.expert_dp:g}" if plan.counts.expert else "-", mem.expert_optimizer.text(),
                     mem.resident.text(), mem.peak.text(), f"{mem.headroom_pct.value:.1f} %"]
        verdict = s.verdict + ("  <- chosen" if s is plan.chosen else "")
        table.add_row(str(s.rollout_nodes), str(s.train_gpus), *cells, s.train_step.text(), verdict)
    return table


def _shown(plan: Plan) -> list[Option]:
    """The options worth a row: every one whose split fits (ipc only where it can run), and the chosen one."""
    return [o for o in plan.options if o is plan.option or (
        o.split.verdict not in ("OOM", "invalid") and (o.placement == "colocate" or o.method != "ipc"))]


def _step_table(plan: Plan) -> Table:
    table = _table("Step time (seconds) of each option: placement, rollout nodes, weight-sync method",
                   ["placement", "rollout nodes", "sync", "rollout", "reward", "train", "sync s", "offload", "total",
                    "sync share", "status"])
    for o in _shown(plan):
        row = o.step
        status = o.status + ("  <- chosen" if o is plan.option else "")
        table.add_row(o.placement, str(o.split.rollout_nodes), row.method, num(row.rollout_s), num(row.reward_s),
                      num(row.train_s), num(row.sync_s), num(row.offload_s), num(row.total_s),
                      f"{row.share_pct(row.sync_s):.1f} %", status)
    return table


def _overlap_lines(plan: Plan) -> list[str]:
    """How the step table's totals add up where rl.max_staleness lets the experience run beside training."""
    job = plan.job
    if job.job.kind != "rl" or job.rl.max_staleness == 0:
        return []
    o = plan.option.step
    how = (f"the chosen one hides {num(o.hidden_s)} s a step" if o.overlapped else
           "the chosen one adds them up (colocated on a GPU, or offloaded)")
    return [f"rl.max_staleness {job.rl.max_staleness}: separate or on CPU cores, a step is max(rollout + reward, "
            f"train) + sync + offload; {how}"]


def _choice(plan: Plan) -> list[str]:
    """Which option the plan chose and by how much it beats the next, or why a faster one is not it."""
    job, o = plan.job, plan.option
    total = o.step.total_s
    verb = "the fastest allowed option the job can run" if o.runnable else "refused by the pre-flight below"
    lines = [f"chosen: {o.where}, {o.split.train_gpus} training GPUs: {num(total)} s/step, {verb} "
             f"(placement.mode = {job.placement.mode}, sync.method = {job.sync.method})"]
    runner_up, faster = plan.alternatives()
    if runner_up is not None:
        d = runner_up.step.total_s - total
        lines.append(f"  next: {runner_up.where}: {num(runner_up.step.total_s)} s/step "
                     f"({'+' if d >= 0 else '-'}{num(abs(d))} s, {100 * d / total:+.1f} %)")
    if faster is not None:
        excluded = plan.excluded_by(faster)
        status = f"excluded by {excluded}" if excluded else faster.status
        why = "; ".join(faster.reasons) or f"{faster.split.memory.headroom_pct.value:.1f} % headroom"
        lines.append(f"  faster but {status}: {faster.where}: {num(faster.step.total_s)} s/step "
                     f"(-{num(total - faster.step.total_s)} s)" + (f": {why}" if not faster.advised else ""))
    return lines


def _blockers(plan: Plan) -> list[str]:
    """Each reason an option shown cannot run, once, with the options it stops (`--explain`)."""
    stopped: dict[str, list[str]] = {}
    for o in _shown(plan):
        for b in o.blockers:
            stopped.setdefault(b, []).append(f"{o.placement} {o.split.rollout_nodes} {o.method}")
    return [f"  {', '.join(names)}: {b}" for b, names in stopped.items()]


def _explain(lines: list[str], quantities: list[Q]) -> None:
    lines.extend(f"    {q.explain()}" for q in quantities)


def _sections(plan: Plan, problems: list[str], explain: bool) -> list[Any]:
    job, hw, c = plan.job, plan.job.hardware, plan.counts
    p = job.parallel
    out: list[Any] = [
        f"rlslurm plan: {job.job.name} ({job.job.kind}) on {hw.nodes} nodes x {hw.gpus_per_node} {hw.profile} "
        f"({hw.gpu_mem_gb:g} GB) = {hw.total_gpus} GPUs",
        f"model {job.model.name}: {params(c.expert)} expert + {params(c.dense)} dense params, "
        f"{params(c.active)} active; "
        f"TP {p.tp} PP {p.pp} CP {p.cp} EP {p.ep}, micro batch {p.micro_batch_size} x {p.seq_len} tokens, "
        f"recompute {job.resolved_memory.recompute}",
    ]
    if explain and c.overridden:
        out.append(f"    the shape gives {params(c.shape_expert)} expert, {params(c.shape_dense)} dense, "
                   f"{params(c.shape_active)} active; overridden by model.{', model.'.join(c.overridden)}")
    out.append(_memory_table(plan))
    lines = [f"recommendation: {plan.advice}"]
    if plan.fused_ce_what_if is not None:
        f = plan.fused_ce_what_if
        lines.append(f"  with memory.fused_ce: true the peak would be {f.peak.text()} = "
                     f"{100 - f.headroom_pct.value:.1f} % of {hw.gpu_mem_gb:g} GB (saves logits "
                     f"{f.activations.logits.text()})")
    if explain:
        for s in plan.splits:
            if s.memory is not None:
                lines.append(f"  {s.train_gpus} training GPUs:")
                chosen = s is plan.chosen
                _explain(lines, s.memory.terms + [s.train_step] if chosen else
                         [s.memory.expert_optimizer, s.memory.resident, s.memory.peak, s.memory.headroom_pct])
            for rule in s.broken:
                lines.append(f"  {s.train_gpus} training GPUs: {rule.message}")
    colo = plan.colocate
    fits = ("fits without offload" if colo.fits_without_offload else
            "does not fit: needs offload of the training state, which the runtime does not do yet")
    lines += ["", f"colocate (all {hw.total_gpus} GPUs train, rollout time-shares them): engine needs "
                  f"{colo.engine_need_gb.text()}, training peak leaves {colo.free_gb.text()} -> {fits}",
              f"  offload {colo.offload_each_way_s.text()} each way, {colo.offload_per_step_s.text()} per step; "
              f"host RAM {colo.host_ram_per_node_gb.text()} per node (hardware.host_ram_gb {hw.host_ram_gb:g})"]
    if explain:
        _explain(lines, [colo.free_gb, colo.engine_need_gb, colo.offload_each_way_s, colo.offload_per_step_s,
                         colo.host_ram_per_node_gb])
    r = job.rollout
    lines += ["", f"rollout: weights {plan.weights.text()}, KV cache {plan.kv.per_token.text()}/token "
                  f"({plan.kv.per_token_per_gpu.text()} per GPU at rollout.tp {r.tp})"]
    cap = plan.rollout
    if cap is not None:
        lines.append(f"  {cap.engines} engine(s) of TP {r.tp} on {cap.rollout_gpus} GPUs: KV space "
                     f"{cap.kv_space_per_gpu.text()} per GPU -> {cap.tokens_per_engine.value:,.0f} tokens -> "
                     f"{cap.seqs_total.value:,.0f} concurrent sequences of {r.max_seq_len} "
                     f"(a step makes {plan.reward.responses})")
    others = ", ".join(f"{name} {num(q.value)}" for name, q in plan.roofline_profiles.items())
    lines.append(f"  decode roofline {plan.roofline.text()} on {hw.profile}; compare: {others} tok/s/GPU")
    if explain:
        _explain(lines, [plan.weights, plan.kv.per_token, plan.kv.per_token_per_gpu, plan.roofline])
        if cap is not None:
            _explain(lines, [cap.weights_per_gpu, cap.kv_space_per_gpu, cap.tokens_per_engine, cap.seqs_per_engine])
    rw = plan.reward
    lines += ["", "weight sync per step: " + ", ".join(f"{m} {q.text()}" for m, q in plan.syncs.items())
              + f" (chosen: {plan.sync_method})",
              f"reward: {rw.responses} responses: serial {rw.serial.text()}, concurrent {rw.concurrent.text()}; "
              f"the step uses {rw.used.text()} ({rw.used.how})"]
    if explain:
        _explain(lines, list(plan.syncs.values()) + [rw.serial, rw.concurrent, rw.used])
    lines.append(f"speed: {plan.speed.how}; rollout {plan.rollout_s.text()} per step")
    if explain:
        _explain(lines, [plan.rollout_s, plan.chosen.train_step])
    cal = plan.calibration
    if cal is not None:
        lines.append(f"calibrated from {cal.run}: measured {', '.join(cal.measured()) or 'nothing'}; "
                     f"still assumed: {', '.join(cal.assumed()) or 'nothing'}")
    out += ["\n".join(lines), _step_table(plan)]
    lines = _overlap_lines(plan) + _choice(plan) + [plan.gpus.text(), _network_line(job)]
    if explain:
        lines += _blockers(plan)
        _explain(lines, plan.recompute)
    lines += [""] + [f"switching from disk sync: {a.method} saves {a.saved_per_step.text()} x {job.timing.total_steps} "
                     f"steps = {a.saved_total_h.text()} of the whole cluster ({a.saved_gpu_h.text()})"
                     for a in plan.amortisation]
    if explain:
        _explain(lines, [plan.rl_step_s] + [q for a in plan.amortisation for q in (a.saved_per_step, a.saved_total_h)])
    ck, ckc = plan.checkpoint, job.checkpoint
    step = plan.checkpoint_step_s.value
    cost_s = plan.checkpoint_cost_s
    young = young_interval_s(cost_s, ckc.mtbf_h * 3600)
    capped = (f"Young {young:,.0f} s capped at the time limit {plan.checkpoint_cap_s:,.0f} s"
              if young > plan.checkpoint_cap_s else f"Young {ck.young_s:,.0f} s")
    lines += ["", f"checkpoint (C = {num(cost_s)} s, MTBF {ckc.mtbf_h:g} h): "
                  f"{capped} = {ck.young_steps} train steps of {step:g} s; "
                  f"Daly {ck.daly_s:,.0f} s = {ck.daly_steps} steps; "
                  f"= {max(1, round(ck.young_s / plan.rl_step_s.value))} RL steps of {plan.rl_step_s.text()}"]
    if explain:
        lines.append(f"    Young = sqrt(2 x C {num(cost_s)} s x MTBF {ckc.mtbf_h * 3600:g} s) = {ck.young_s:,.0f} s")
    lines += [""] + timeouts(plan).lines()
    lines += [""] + [f"warning: {w}" for w in plan.warnings]
    lines += ([f"preflight: REFUSE: {pr}" for pr in problems] if problems
              else ["preflight: ok (rlslurm submit would run this split)"])
    out.append("\n".join(lines))
    return out


def _network_line(job) -> str:
    env = network_env(job.network)
    if not env:
        return "network environment: none set (network:), each library's defaults"
    return ("network environment of every trainer rank, engine and the reward service: "
            + " ".join(f"{k}={v}" for k, v in env.items()))


def text(plan: Plan, problems: list[str], explain: bool) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=WIDTH, color_system=None, force_terminal=False, highlight=False,
                      soft_wrap=True)
    for part in _sections(plan, problems, explain):
        console.print(part)
    return buffer.getvalue()


def _key(q: Q) -> str:
    unit = {"%": "pct", "tok/s/GPU": "tok_s_per_gpu", "s/step": "s_per_step", "GPU-h": "gpu_h"}.get(q.unit, q.unit)
    return re.sub(r"[^a-z0-9]+", "_", f"{q.label} {unit}".lower()).strip("_")


def _qs(*quantities: Q) -> dict[str, float]:
    return {_key(q): round(q.value, 4) for q in quantities}


def _terms(*quantities: Q) -> dict[str, str]:
    return {_key(q): q.explain() for q in quantities}


def _option(o: Option) -> dict[str, Any]:
    r = o.step
    return {"placement": o.placement, "rollout_nodes": o.split.rollout_nodes, "train_gpus": o.split.train_gpus,
            "sync_method": r.method, "status": o.status, "runnable": o.runnable, "blockers": list(o.blockers),
            "rollout_s": round(r.rollout_s, 6), "reward_s": round(r.reward_s, 6), "train_s": round(r.train_s, 6),
            "sync_s": round(r.sync_s, 6), "offload_s": round(r.offload_s, 4), "idle_s": round(r.idle_s, 6),
            "total_s": round(r.total_s, 6), "overlapped": r.overlapped, "hidden_s": round(r.hidden_s, 6),
            "sync_share_pct": round(r.share_pct(r.sync_s), 4)}


def as_json(plan: Plan, problems: list[str]) -> str:
    job, hw, c = plan.job, plan.job.hardware, plan.counts
    splits = []
    for s in plan.splits:
        row: dict[str, Any] = {"rollout_nodes": s.rollout_nodes, "train_gpus": s.train_gpus,
                               "rollout_gpus": s.rollout_gpus, "verdict": s.verdict,
                               "broken_rules": [r.message for r in s.broken], **_qs(s.train_step)}
        if s.memory is not None:
            m = s.memory
            row.update(dp=m.dp, expert_dp=m.expert_dp, **_qs(*m.terms), terms=_terms(*m.terms),
                       peak_activations_gb=round(m.peak_activations_gb, 6))
        splits.append(row)
    colo, rw = plan.colocate, plan.reward
    runner_up, faster = plan.alternatives()
    data = {
        "job": {"name": job.job.name, "kind": job.job.kind},
        "hardware": {"profile": hw.profile, "nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node,
                     "gpu_mem_gb": hw.gpu_mem_gb, "hbm_bandwidth_tb_s": hw.hbm_tb_s},
        "params": {"dense_params": c.dense, "expert_params": c.expert, "active_params": c.active,
                   "total_params": c.total, "overridden": list(c.overridden)},
        "splits": splits,
        "recommendation": {"rollout_nodes": plan.recommended_rollout_nodes, "advice": plan.advice},
        "chosen": {"placement": plan.placement, "rollout_nodes": plan.chosen.rollout_nodes,
                   "train_gpus": plan.chosen.train_gpus, "sync_method": plan.sync_method,
                   "step_s": round(plan.option.step.total_s, 4),
                   "next": _option(runner_up) if runner_up is not None else None,
                   "faster_not_chosen": _option(faster) if faster is not None else None,
                   **({"fused_ce_peak_gb": round(plan.fused_ce_what_if.peak.value, 4)}
                      if plan.fused_ce_what_if is not None else {})},
        "gpus": plan.gpus.as_dict(),
        "network_env": network_env(job.network),
        "colocate": {"fits_without_offload": colo.fits_without_offload, "host_ram_fits": colo.host_ram_fits,
                     **_qs(colo.free_gb, colo.engine_need_gb, colo.offload_each_way_s, colo.offload_per_step_s,
                           colo.host_ram_per_node_gb)},
        "rollout": {**_qs(plan.weights, plan.kv.per_token, plan.kv.per_token_per_gpu, plan.roofline),
                    "roofline_by_profile_tok_s_per_gpu": {n: round(q.value, 1)
                                                          for n, q in plan.roofline_profiles.items()},
                    **({"engines": plan.rollout.engines,
                        **_qs(plan.rollout.kv_space_per_gpu, plan.rollout.tokens_per_engine, plan.rollout.seqs_total)}
                       if plan.rollout is not None else {})},
        "sync_s": {m: round(q.value, 6) for m, q in plan.syncs.items()},
        "speed": {"matmul_flops": plan.speed.flops, "op_s": plan.speed.op_s, "hbm_gb_s": plan.speed.hbm_gb_s,
                  "how": plan.speed.how},
        "rollout_step_s": round(plan.rollout_s.value, 6),
        "calibration": ({**plan.calibration.as_dict(), "measured": plan.calibration.measured(),
                         "assumed": plan.calibration.assumed()} if plan.calibration is not None else None),
        "reward": {"responses": rw.responses, **_qs(rw.serial, rw.concurrent, rw.used)},
        "options": [_option(o) for o in plan.options],
        "recompute": _qs(*plan.recompute),
        "amortisation": [{"method": a.method, **_qs(a.saved_per_step, a.saved_total_h, a.saved_gpu_h)}
                         for a in plan.amortisation],
        "checkpoint": {"young_s": round(plan.checkpoint.young_s, 2), "daly_s": round(plan.checkpoint.daly_s, 2),
                       "young_steps": plan.checkpoint.young_steps, "daly_steps": plan.checkpoint.daly_steps,
                       "step_s": plan.checkpoint_step_s.value, "cap_s": plan.checkpoint_cap_s,
                       "cost_s": round(plan.checkpoint_cost_s, 4),
                       "rl_step_s": round(plan.rl_step_s.value, 4)},
        "timeout_chain": timeouts(plan).as_json(),
        "warnings": plan.warnings,
        "preflight_problems": problems,
    }
    return json.dumps(data, indent=2) + "\n"


def render_text(plan: Plan, explain: bool = False) -> str:
    """The human view of `plan`, its preflight problems at the end (what `rlslurm plan` prints)."""
    return text(plan, preflight(plan), explain)


def render_json(plan: Plan) -> str:
    """The machine view: every number with its unit in the key (`rlslurm plan --json`, the run's plan.json)."""
    return as_json(plan, preflight(plan))
