"""Every benchmark script runs in its smallest mode and writes well-formed JSON with the expected keys.

The new scripts (async, weight sync, controller, algorithms) run with ``--smoke``; the earlier ones
(transport, quant, engine) with ``--quick`` and their smallest size options. No benchmark figure is
asserted: only that the script exits 0 and that its JSON has the documented tables, columns and
numeric types (a figure may legitimately be NaN, e.g. a KL that PPO does not log).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.integration.runs import run_script

pytestmark = [pytest.mark.slow, pytest.mark.integration]
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
COMMON_KEYS = {"benchmark", "date", "command", "quick", "smoke", "machine", "tables"}


def run_bench(procs, tmp_path, name: str, *args: str, timeout_s: float = 280.0) -> dict:
    out = tmp_path / f"{name}.json"
    log = tmp_path / f"{name}.log"
    rc = run_script(procs, os.path.join(SCRIPTS, f"{name}.py"), *args, "--json", str(out), log=log, timeout=timeout_s)
    assert rc == 0, f"{name} exited {rc}:\n{log.read_text()[-3000:]}"
    data = json.loads(out.read_text())
    assert COMMON_KEYS <= set(data), f"{name}: missing {COMMON_KEYS - set(data)}"
    assert data["benchmark"] == name
    assert data["machine"]["cpus"] >= 1
    return data


def check_rows(rows: list[dict], numeric: list[str], text: tuple[str, ...] = ()) -> None:
    assert rows, "empty table"
    for row in rows:
        for key in numeric:
            assert key in row, f"missing column {key!r} in {sorted(row)}"
            value = row[key]
            assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{key}={value!r}"
            assert not math.isinf(value), f"{key} is infinite"
        for key in text:
            assert isinstance(row.get(key), str), f"{key}={row.get(key)!r}"


@pytest.mark.timeout(900)  # two real runs, about 30 s on an idle 2-core machine: the limits are hang guards
def test_bench_async_smoke_writes_rows_per_eta_with_speedup_and_bound(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_async", "--smoke", timeout_s=600)
    rows = data["tables"]["runs"]
    assert [r["eta"] for r in rows] == data["etas"] == [0, 1]
    check_rows(rows, ["samples_per_s", "speedup", "bound", "latency_bound", "efficiency", "learner_busy", "gen_busy", "G_s",
                      "T_s", "wait_s", "step_s", "max_staleness"])
    assert all(isinstance(r["worker_busy_s"], dict) for r in rows)
    check_rows(data["tables"]["sync_breakdown"], ["step_s", "learner_s", "propagate_s", "generate_s", "collect_s"])


@pytest.mark.timeout(1800)  # about 2 min on an idle 2-core machine, far more where int8 has no VNNI: hang guards
def test_bench_async_smollm2_regime_runs_the_real_model_per_worker_format(procs, tmp_path):
    """The rollout-bound regime on SmolLM2-135M-Instruct: a few short steps per worker format, and the
    columns that say whether generation dominated."""
    data = run_bench(procs, tmp_path, "bench_async", "--smoke", "--regime", "smollm2", "--etas", "0", "--steps", "3",
                     "--quant-formats", "fp32,int8", "--set", "task.eval_size=4", "rollout.max_new_tokens=8",
                     timeout_s=1500)
    rows = data["tables"]["runs"]
    assert [(r["fmt"], r["eta"]) for r in rows] == [("fp32", 0), ("int8", 0)]
    assert "+experiment=smollm2_signed_sums" in data["overrides"] and data["workers"] == 1
    check_rows(rows, ["samples_per_s", "vs_first_fmt", "G_over_T", "G_s", "T_s", "step_s"])
    assert all(isinstance(r["rollout_bound"], bool) for r in rows)


def test_bench_weightsync_smoke_writes_every_stage_per_format(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_weightsync", "--smoke")
    rows = data["tables"]["sync"]
    assert [r["format"] for r in rows] == ["fp32", "bf16", "int8", "nvfp4"]
    check_rows(rows, ["params_M", "MB", "bytes_vs_fp32", "gather_s", "quantize_s", "send_s", "unpack_s", "load_s",
                      "total_s", "memcpy_s", "total_vs_memcpy", "send_vs_memcpy"], text=("model", "format"))
    check_rows(data["tables"]["raw"], ["bytes", "gather_s", "quantize_s", "serve_s", "send_s", "load_s", "memcpy_s"])


def test_bench_delta_smoke_syncs_whole_and_by_delta_and_the_two_actors_agree(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_delta", "--smoke")  # the child checks the two actors' bytes agree
    rows = data["tables"]["delta"]
    assert [(r["run"], r["layout"], r["format"]) for r in rows] == [
        (run, lay, fmt) for run in ("full", "lora") for fmt in ("int8", "nvfp4") for lay in ("plain", "emb")]
    check_rows(rows, ["changed_frac", "whole_MB", "delta_MB", "delta_vs_whole_bytes", "whole_s", "delta_s",
                      "delta_vs_whole_s", "whole_vs_memcpy", "delta_vs_memcpy"], text=("run", "layout", "format"))
    assert all(r["delta_MB"] < r["whole_MB"] and 0 < r["changed_frac"] <= 1 for r in rows)


def test_bench_weightsync_bucketed_smoke_syncs_four_ways_and_every_actor_agrees(procs, tmp_path):
    # what `bench_weightsync.py --bucket-mb` runs; its child checks that the four actors hold the same bytes
    data = run_bench(procs, tmp_path, "bench_buckets", "--bucket-mb", "0.0625", "--smoke")
    (row,) = data["tables"]["buckets"]
    check_rows([row], ["whole_MB", "piece_s", "bucket_s", "bucket_vs_piece_s", "piece_recv_MB", "bucket_recv_MB",
                       "buckets", "bucket_undo_MB", "piece_delta_s", "bucket_delta_s", "bucket_delta_recv_MB",
                       "piece_vs_memcpy", "bucket_vs_memcpy"], text=("run", "format"))
    assert row["buckets"] > 1 and row["bucket_recv_MB"] <= 0.0625 * 2**20 / 1e6 < row["piece_recv_MB"]


def test_bench_controller_smoke_drives_the_real_controller_with_1_and_4_workers(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_controller", "--smoke")
    rows = data["tables"]["controller"]
    assert [r["workers"] for r in rows] == [1, 4]
    check_rows(rows, ["accepted_per_s", "vs_1_worker", "consumed_per_s", "learner_steps", "rss_idle_MB",
                      "rss_peak_MB", "samples_logged"])


@pytest.mark.timeout(900)
def test_bench_algos_smoke_writes_summary_curves_and_plots(procs, tmp_path):
    plots = tmp_path / "plots"
    # two real training runs: the limit is only a hang guard (they take ~1 min each on an idle machine)
    data = run_bench(procs, tmp_path, "bench_algos", "--smoke", "--plots", str(plots), timeout_s=600)
    rows = data["tables"]["summary"]
    assert [r["config"] for r in rows] == ["sync-fp32", "acr-nvfp4-eta4"]
    check_rows(rows, ["runs", "eval_acc", "eval_ci95", "eval_min", "eval_max", "eval_vs_sync", "collapsed",
                      "final_reward", "reward_auc", "reward_auc_ci95", "kl_k3", "wall_s"], text=("config",))
    assert all(r["runs"] == 1 and r["collapsed"] in (0, 1) for r in rows)
    # every cell runs with the comparison's settings: two optimizer updates, one aggregation
    assert {"learner.n_minibatches=2", "learner.total_steps=4"} <= set(data["common_overrides"])
    assert data["configs"]["acr-nvfp4-eta4"] == ["rollout.eta=4", "quant=nvfp4", "algo=acr", "algo.agg=token-mean"]
    for name, runs in data["runs"].items():
        assert len(runs) == 1, name
        assert runs[0]["reward"], f"{name}: no reward curve"
        assert runs[0]["eval"], f"{name}: no eval curve"
    assert data["plots"] and all(os.path.exists(p) for p in data["plots"])


@pytest.mark.parametrize(("name", "args"), [
    ("bench_transport", ["--quick", "--rounds", "5"]),
    ("bench_quant", ["--quick", "--formats", "int8", "--batch-sizes", "1", "--steps", "4", "--rounds", "1"]),
    ("bench_engine", ["--quick", "--formats", "fp32,int8", "--batch-sizes", "1", "--new-tokens", "4"]),
])
def test_earlier_bench_scripts_write_well_formed_json(procs, tmp_path, name, args):
    data = run_bench(procs, tmp_path, name, *args)
    assert data["tables"] and all(isinstance(rows, list) and rows for rows in data["tables"].values())
    if name == "bench_engine":  # the default --head-formats adds int8 with the output head quantized
        assert "native-int8+head" in {r["path"] for r in data["tables"]["throughput"]}
    for rows in data["tables"].values():
        check_rows(rows, [k for k, v in rows[0].items() if isinstance(v, float)])


def test_bench_kernels_smoke_times_every_chosen_path_against_its_alternative(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_kernels", "--smoke")
    pairs = data["tables"]["pairs"]
    gemms = [r for r in pairs if r["row"] == "int8_gemm"]
    assert [r["row"] for r in pairs if r["row"] != "int8_gemm"] == [
        "fp4_block_amax", "fp4_zero_to_inf", "all_finite", "int8_row_absmax", "int8_row_absmax", "int8_act_amax",
        "fp8_gemm", "int8_weight_only", "sample_batch64"]
    # each of 4 shapes (M = 1 and 16, two projections): the chosen int8 kernel against every other one that runs
    # here and against an fp32 GEMM
    from asyncrl.quant.cpu_int8 import kernel_status

    others = 3 if kernel_status() == "" else 2
    assert len({r["shape"] for r in gemms}) == 4 and len(gemms) == 4 * others
    assert all(r["alternative"] != r["chosen"] for r in gemms) and "fp32 GEMM" in {r["alternative"] for r in gemms}
    check_rows(pairs, ["chosen_us", "alternative_us", "alt_over_chosen", "ratio_min", "ratio_max", "load_median"],
               text=("row", "shape", "chosen", "alternative"))
    chunks = data["tables"]["chunks"]
    assert [(r["format"], r["chunk_log2"]) for r in chunks] == [(f, c) for f in ("nvfp4", "int8") for c in range(14, 20)]
    check_rows(chunks, ["best_ms", "vs_chosen", "ratio_min", "ratio_max"], text=("format",))
    assert [r["vs_chosen"] for r in chunks if r["chunk_log2"] == 18] == [1.0, 1.0]  # the chosen size against itself


@pytest.mark.timeout(900)  # above its own 600 s guard; bf16 rows run far slower on a CPU without avx512_bf16
def test_bench_learner_quick_on_the_tiny_model_writes_every_row(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_learner", "--quick", "--model", "tiny", "--samples", "8",
                     "--new-tokens", "8", timeout_s=600)
    rows = data["tables"]["rows"]
    names = [r["row"] for r in rows]
    assert names == ["fsdp-ws1-mb64", "full", "full-fsdp-ws1", "full-bf16", "full-bf16-uncapped", "lora", "lora-bf16",
                     "lora-glibc-default", "lora-int8-base", "lora-nvfp4-base", "lora-aligned-int8", "full-aligned-int8"]
    check_rows(rows, ["peak_rss_gb", "rss_ratio", "s_per_1k_tokens", "time_ratio", "cpu_s_per_1k_tokens", "cpu_ratio",
                      "prox_s", "trainable_params", "trained_tokens"], text=("row",))
    by = dict(zip(names, rows, strict=True))
    assert by["lora"]["trainable_params"] < by["full"]["trainable_params"]  # LoRA trains adapters only
    # the same LoRA under bf16 and with default malloc; the same full model with default kernel caches
    assert by["lora-bf16"]["trainable_params"] == by["lora-glibc-default"]["trainable_params"] == by["lora"]["trainable_params"]
    assert by["full-bf16-uncapped"]["trainable_params"] == by["full"]["trainable_params"]
    assert by["full-fsdp-ws1"]["trainable_params"] == by["full"]["trainable_params"]  # the same model, wrapped
    # a packed base holds fewer bytes of weights for the same adapters; alignment changes no parameter
    for base in ("lora-int8-base", "lora-nvfp4-base"):
        assert by[base]["weights_gb"] < by["lora"]["weights_gb"]
        assert by[base]["trainable_params"] == by["lora"]["trainable_params"]
    assert by["lora-nvfp4-base"]["weights_gb"] < by["lora-int8-base"]["weights_gb"]
    assert by["lora-aligned-int8"]["weights_gb"] == by["lora"]["weights_gb"]
    assert by["full-aligned-int8"]["trainable_params"] == by["full"]["trainable_params"]


@pytest.mark.timeout(900)  # above its own 600 s guard
def test_bench_learner_vary_reports_memory_after_every_step(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_learner", "--model", "tiny", "--samples", "8", "--new-tokens", "8",
                     "--steps", "3", "--vary", "--rows", "full,full-bf16", timeout_s=600)
    rows = data["tables"]["rows"]
    assert [r["row"] for r in rows] == ["full", "full-bf16"] and data["vary"] is True
    for r in rows:
        assert len(r["rss_after_step_gb"]) == 3 and all(v > 0 for v in r["rss_after_step_gb"])
        assert r["rss_growth_gb"] == pytest.approx(r["rss_after_step_gb"][-1] - r["rss_after_step_gb"][0])


@pytest.mark.timeout(900)
def test_memory_timeline_names_every_process_of_a_real_run(procs, tmp_path):
    data = run_bench(procs, tmp_path, "memory_timeline", "--quick", "--interval", "0.1", "--window", "5",
                     timeout_s=600)
    peaks = data["role_peaks"]
    assert {"launcher", "controller", "learner", "worker-0"} <= set(peaks)
    assert all(p["gb"] > 0 and p["t_s"] >= 0 for p in peaks.values())
    assert data["job_peak_gb"] >= max(p["gb"] for p in peaks.values())
    rows = data["tables"]["rows"]
    assert rows and any("learner_max_gb" in r for r in rows)
    assert all(r.get("learner_min_gb", 0) <= r.get("learner_max_gb", 0) for r in rows)


@pytest.mark.timeout(1500)  # about 90 s on an idle 2-core machine: the limits are hang guards
def test_bench_recipes_smoke_runs_a_row_and_the_two_stage_curriculum(procs, tmp_path):
    data = run_bench(procs, tmp_path, "bench_recipes", "--smoke", "--rows", "lora-2e-4,curriculum", "--seeds", "0",
                     "--parallel", "2", "--keep", str(tmp_path / "runs"), timeout_s=1200)
    runs = data["tables"]["runs"]
    assert [r["run"] for r in runs] == ["lora-2e-4-s0", "curriculum-s0"]
    check_rows(runs, ["steps", "eval_n", "eval_step0", "eval_final", "reward_first20", "len_first5"], text=("alarms",))
    assert all(r["steps"] > 0 for r in runs)
    # the curriculum's second stage trained the model its first stage exported
    cfg = json.loads((tmp_path / "runs" / "curriculum-s0" / "config.json").read_text())
    assert cfg["model"]["name"] == "path"
    assert cfg["model"]["path"] == str(tmp_path / "runs" / "curriculum-s0-a" / "model")
    check_rows(data["tables"]["rows"], ["seeds", "eval_step0", "eval_final_mean", "gain"], text=("row",))
    assert all(isinstance(r["learns"], bool) for r in data["tables"]["rows"])
