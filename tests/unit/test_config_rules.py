"""A value that the chosen layout (or job kind, engine, transport, reward service) would ignore is an error
naming both keys (rlslurm/config_rules.py); the examples and every default are free of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rlslurm.config import JobConfig, load_config
from rlslurm.config_rules import ignored_values
from rlslurm.configfile import to_dict
from rlslurm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

# (YAML, fragments of the one-line message): each names the ignored key and the key that makes it ignored.
IGNORED = [
    ("placement: {mode: colocate, rollout_nodes: 1}\n",
     ["placement.rollout_nodes = 1 is ignored with placement.mode = 'colocate'"]),
    ("placement: {mode: separate, rollout_nodes: 0}\n",
     ["placement.rollout_nodes = 0 contradicts placement.mode = 'separate'"]),
    ("placement: {rollout_nodes: 0}\n", ["placement.rollout_nodes = 0 is ignored with placement.mode = 'auto'"]),
    ("placement: {mode: separate, offload: false}\n",
     ["placement.offload = False is ignored with placement.mode = 'separate'"]),
    ("placement: {rollout_nodes: 1, colocate_min_seqs: 4}\n",
     ["placement.colocate_min_seqs = 4 is ignored with placement.rollout_nodes = 1"]),
    ("hardware: {nodes: 3}\nplacement: {mode: separate, rollout_nodes: 2}\nrollout: {engines: 3}\n",
     ["rollout.engines = 3 is not a multiple of placement.rollout_nodes = 2", "so 4 start and 1 of them"]),
    ("placement: {mode: separate, rollout_nodes: 1}\nrollout: {engines: 4}\n",
     ["rollout.engines = 4 on placement.rollout_nodes = 1", "hardware.gpus_per_node = 2"]),
    ("rollout: {tp: 2}\nmodel: {heads: 4}\n", ["rollout.tp = 2 is ignored with rollout.engine = 'hf'"]),
    ("job: {kind: sft}\nplacement: {mode: separate, rollout_nodes: 1}\n",
     ["placement.rollout_nodes = 1 is ignored with job.kind = 'sft'"]),
    ("sync: {method: broadcast, weights_dir: /shared/w}\n",
     ["sync.weights_dir = '/shared/w' is ignored with sync.method = 'broadcast'"]),
    ("sync: {keep_versions: 5}\n", ["sync.keep_versions = 5 is ignored with sync.method = 'auto'"]),
    ("sync: {method: disk, bucket_mb: 8}\n", ["sync.bucket_mb = 8.0 is ignored with sync.method = 'disk'"]),
    ("sync: {method: ipc, store_port: 29500}\nplacement: {mode: colocate}\n",
     ["sync.store_port = 29500 is ignored with sync.method = 'ipc'"]),
    ("sync: {store_port: 29500}\nplacement: {mode: colocate}\n",
     ["sync.store_port = 29500 is ignored with sync.method = 'auto' (ipc when colocated)"]),
    ("sync: {method: ipc}\nplacement: {mode: separate, rollout_nodes: 1}\n",
     ["sync.method = 'ipc' needs colocated engines", "placement.mode = 'separate'"]),
    ("reward: {scorer: judge, endpoint: 'http://j/v1'}\n",
     ["reward.scorer = 'judge' is ignored with reward.service = 'inline'"]),
    ("reward: {batch_size: 64}\n", ["reward.batch_size = 64 is ignored with reward.service = 'inline'"]),
    ("reward: {service: local, partition: cpu}\n",
     ["reward.partition = 'cpu' is ignored with reward.service = 'local'"]),
    ("reward: {service: component, partition: cpu}\nplacement: {mode: colocate}\n",
     ["reward.service = 'component' needs a rollout component", "placement.mode = 'colocate'"]),
    ("reward: {service: local, endpoint: 'https://user:secret@j/v1'}\n",
     ["reward.endpoint = '<set>' is ignored with reward.scorer = 'rule'"]),
    ("reward: {service: local, judge_model: gpt}\n",
     ["reward.judge_model = 'gpt' is ignored with reward.scorer = 'rule'"]),
    ("reward: {service: local, scorer: code, format_regex: '^\\d+$'}\n",
     ["reward.format_regex", "is ignored with reward.scorer = 'code'"]),
    ("reward: {service: local, sandbox: {cpu_s: 5}}\n",
     ["reward.sandbox.cpu_s = 5 is ignored with reward.scorer = 'rule'"]),
    ("reward: {service: local, degrade: drop, neutral_score: 0.5}\n",
     ["reward.neutral_score = 0.5 is ignored with reward.degrade = 'drop'"]),
    ("reward: {service: local, retries: 0, retry_backoff_s: 2}\n",
     ["reward.retry_backoff_s = 2.0 is ignored with reward.retries = 0"]),
    ("train: {batch_size: 64}\n", ["train.batch_size = 64 is ignored with job.kind = 'rl'"]),
    ("train: {steps: 10, warmup_steps: 2}\n", ["train.warmup_steps = 2 is ignored with job.kind = 'rl'"]),
    ("model: {topk: 2}\n", ["model.topk = 2 is ignored with model.experts = 0"]),
    ("memory: {activation_gb: 40, temporaries_gb: 3}\n",
     ["memory.temporaries_gb = 3.0 is ignored with memory.activation_gb = 40"]),
    ("cluster: {tasks_per_node: 4}\n", ["cluster.tasks_per_node = 4 differs from hardware.gpus_per_node = 2"]),
    ("cluster: {backend: local, gres_per_node: 'gpu:8'}\n",
     ["cluster.gres_per_node = 'gpu:8' is ignored with cluster.backend = 'local'"]),
    ("cluster: {extra_sbatch: ['--time=10']}\n",
     ["cluster.extra_sbatch[0]", "sets --time, which rlslurm sets from cluster.time_limit_min"]),
    ('cluster: {extra_sbatch: ["--comment=a\\nb"]}\n', ["cluster.extra_sbatch[0]", "one line"]),
    ("diag: {phase_timeouts_s: {rollot: 600}}\n", ["diag.phase_timeouts_s.rollot", "is not a phase", "rollout"]),
]


def rule_id(fragments: list[str]) -> str:
    """A test id that says the rule: its message's fragments, e.g. placement.rollout_nodes=1_is_ignored_with_..."""
    text = " ".join(fragments).replace("'", "").replace(" = ", "=")
    return re.sub(r"[^\w.=]+", "_", text).strip("_")[:100]


@pytest.mark.parametrize("text,fragments", IGNORED, ids=[rule_id(fragments) for _, fragments in IGNORED])
def test_an_ignored_value_is_an_error_naming_both_keys(tmp_path: Path, text: str, fragments: list[str]):
    path = tmp_path / "job.yaml"
    path.write_text("job: {name: x}\n" + text if not text.startswith("job:") else text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "secret" not in message, "a URL's password is never echoed"


def test_every_rule_has_an_id_of_its_own():
    ids = [rule_id(fragments) for _, fragments in IGNORED]
    assert len(set(ids)) == len(ids) and not any(re.fullmatch(r"rule\d+", i) for i in ids)


def test_examples_defaults_and_resolved_configs_have_no_ignored_value(tmp_path: Path):
    jobs = [JobConfig()] + [load_config(p) for p in sorted((ROOT / "examples").glob("*.yaml"))]
    for job in jobs:
        assert list(ignored_values(job)) == [], job.job.name
        again = tmp_path / "resolved.yaml"  # what a run directory holds: every default spelled out
        again.write_text(yaml.safe_dump(to_dict(job), sort_keys=False))
        assert load_config(again) == job


def test_the_ignored_value_stays_allowed_where_it_is_read(tmp_path: Path):
    """The same keys load where the layout uses them (the rules are not blanket bans)."""
    ok = ["placement: {mode: separate, rollout_nodes: 1}\n",
          "placement: {mode: colocate, offload: false}\n",
          "hardware: {nodes: 3}\nplacement: {mode: separate, rollout_nodes: 2}\nrollout: {engines: 4}\n",
          "sync: {method: disk, weights_dir: /shared/w, keep_versions: 5}\n",
          "sync: {method: broadcast, store_port: 29500, bucket_mb: 8}\n",
          "reward: {service: local, scorer: judge, endpoint: 'http://j/v1', judge_model: gpt}\n",
          "reward: {service: component, partition: cpu}\nplacement: {mode: separate, rollout_nodes: 1}\n",
          "reward: {service: local, scorer: code, sandbox: {cpu_s: 5}}\n",
          "job: {kind: sft}\ntrain: {batch_size: 64, warmup_steps: 2, steps: 10}\n",
          "model: {experts: 8, topk: 2}\n",
          "cluster: {backend: slurm, gres_per_node: 'gpu:8', extra_sbatch: ['--account=ml', '--exclusive']}\n",
          "diag: {phase_timeouts_s: {rollout: 600, start: 120}}\n"]
    for text in ok:
        path = tmp_path / "job.yaml"
        path.write_text(text)
        load_config(path)


def test_phases_are_the_ones_the_guard_reports():
    """diag.phase_timeouts_s keys are checked against PHASES: every guard.phase("...") in the code is one."""
    from rlslurm.diag.config import PHASES

    used = set()
    for folder in ("rlslurm", "jobs", "diag"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"""\.phase\(["']([a-z_]+)["']""", path.read_text()))
    used.add("start")  # diag/guard.py's own first phase, before any guard.phase()
    assert used <= set(PHASES), used - set(PHASES)
    assert len(used) >= 10


def test_inline_scores_a_users_rows_by_rule_or_function_and_leaves_the_rest_to_the_service(tmp_path: Path,
                                                                                           monkeypatch):
    """reward.service inline with data: rows: the rule and a user's function run in the controller (no HTTP round
    trip per batch), with their timeout and degrade rule; code, model and judge need the supervised service."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "reference": "2"}\n')
    (tmp_path / "f.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 1.0\n")
    head = "job: {name: x, kind: rl}\ndata: {train: rows.jsonl, eval: rows.jsonl}\n"
    path = tmp_path / "job.yaml"
    for ok in ("reward: {service: inline}\n", "reward: {service: inline, scorer: function, function: f.py, "
                                              "timeout_s: 3, degrade: drop}\n"):
        path.write_text(head + ok)
        load_config(path)
    for bad, fragment in (("reward: {service: inline, scorer: code}\n", "reward.scorer = 'code' needs the supervised "
                                                                       "reward service"),
                          ("reward: {service: inline, batch_size: 8}\n", "reward.batch_size = 8 is ignored with "
                                                                         "reward.service = 'inline'")):
        path.write_text(head + bad)
        with pytest.raises(ConfigError, match="set reward.service: local") as err:
            load_config(path)
        assert fragment in str(err.value)
