"""./scripts/bench PRESET [--quick]: run benchmark presets and write results/PRESET.json and plots;
./scripts/bench results --from DIR: write the results page (and the README's block) from that JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from batchmaker.bench import (
    ceiling,
    chaos,
    door,
    dynet_baseline,
    http,
    idle,
    overload,
    plots,
    report,
    results,
    results_page,
    results_readme,
    servers,
    servers_report,
    stages,
    startup,
    triton_setups,
)
from batchmaker.bench.presets import FULL, PRESETS, QUICK, presets_named
from batchmaker.bench.progress import Progress
from batchmaker.bench.run import MODERATE, ROOT, run_preset
from batchmaker.common.config import RUNNING_BATCH


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__)
    parser.add_argument(
        "preset",
        choices=[
            *PRESETS,
            "ceiling",
            "stages",
            "idle",
            "servers",
            "overload",
            "chaos",
            "startup",
            "http",
            "door",
            "all",
            "results",
        ],
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about a minute per preset)")
    parser.add_argument(
        "--running-batch",
        choices=RUNNING_BATCH,
        help="presets, overload, ceiling and idle: who decides the cellular policy's steps (default: the config's)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="presets and overload: CPU workers of the cellular policy's server (default 1); DyNet runs in as many "
        "processes",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="directory for JSON and PNG files")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=ROOT / "docs" / "benchmarks",
        help="results: the directory of JSON to read (default: docs/benchmarks)",
    )
    parser.add_argument("--page", type=Path, help="results: the page to write (default: DIR/results.md)")
    parser.add_argument("--readme", type=Path, help="results: a README whose results block to rewrite")
    parser.add_argument(
        "--trace-to", metavar="URL", help="ceiling: trace every request, exporting the spans over OTLP/HTTP to URL"
    )
    parser.add_argument(
        "--triton-instances",
        type=int,
        metavar="N",
        help="http: model instances of Triton's dynamic batcher and direct sequence setup (default: one a core)",
    )
    parser.add_argument(
        "--triton-tokens",
        type=int,
        metavar="N",
        default=triton_setups.TOKENS_PER_REQUEST,
        help=f"http: tokens a request in Triton's direct sequence setup (default: {triton_setups.TOKENS_PER_REQUEST})",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.preset == "results":
        page = args.page or args.source / "results.md"
        try:
            results_page.write(args.source, page, args.readme)
        except (results.ResultsError, results_readme.NoReadmeBlock) as exc:
            print(f"results: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {page}" + (f" and the results block of {args.readme}" if args.readme else ""))
        return 0
    sweep = QUICK if args.quick else FULL
    if args.preset in ("ceiling", "all"):
        result = ceiling.run(args.quick, args.out, args.trace_to, args.running_batch)
        print(ceiling.table(result))
        if not all(row["verify"]["ok"] for row in result["rows"]):
            print("ceiling: answers differ from the reference model", file=sys.stderr)
            return 1
        if args.preset == "ceiling":
            return 0
    if args.preset in ("stages", "all"):
        print(stages.table(stages.run(args.quick, args.out)))
        if args.preset == "stages":
            return 0
    if args.preset in ("idle", "all"):
        if not idle.main(args.quick, args.out, args.running_batch):
            print("idle: answers differ from the reference model", file=sys.stderr)
            return 1
        if args.preset == "idle":
            return 0
    if args.preset in ("servers", "all"):
        result = servers.run(args.quick)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "servers.json").write_text(json.dumps(report.finite(result), indent=1))
        print(servers_report.table(result))
        found = servers_report.problems(result)
        if found:
            print(f"servers: {'; '.join(found)}", file=sys.stderr)
            return 1
        if args.preset == "servers":
            return 0
    if args.preset == "overload":
        return 0 if overload.main(args.quick, args.out, args.running_batch, args.workers) else 1
    if args.preset == "chaos":
        return 0 if chaos.main(args.quick, args.out) else 1
    if args.preset == "startup":
        startup.main(args.quick, args.out)
        return 0
    if args.preset == "http":
        try:
            setups = triton_setups.setups(args.triton_instances, args.triton_tokens)
        except ValueError as exc:  # a Triton setup that cannot be: no instance, no token a request
            print(f"http: {exc}", file=sys.stderr)
            return 2
        result = http.run(args.quick, setups)
        _write_json(args.out, "http", result)
        print(http.table(result))
        wrong = [way for way, check in http.checks(result).items() if not check["ok"]]
        if wrong:
            print(f"http: answers differ from the reference model: {', '.join(wrong)}", file=sys.stderr)
        return 1 if wrong else 0
    if args.preset == "door":
        result = door.run(args.quick)
        _write_json(args.out, "door", result)
        print(door.table(result))
        refused = door.wrong(result)
        if refused:
            print(f"door: refused or answers differ from the reference model: {', '.join(refused)}", file=sys.stderr)
        return 1 if refused else 0
    names = presets_named(args.preset)
    steps = sum(len(PRESETS[n].policies) * (len(sweep.fractions) + len(MODERATE) + 1) for n in names)
    progress = Progress(steps)
    args.out.mkdir(parents=True, exist_ok=True)
    wrong = []
    outputs = []
    for name in names:
        result = run_preset(PRESETS[name], sweep, progress, args.running_batch, args.workers)
        result["summary"] = report.summarize(result)
        result["targets"] = report.targets(result, result["summary"])
        if name == "treelstm":
            try:
                summary = result["summary"]
                result["dynet"] = dynet_baseline.section(
                    PRESETS[name], summary, args.quick, args.running_batch, args.workers
                )
            except dynet_baseline.DyNetError as exc:
                result["dynet"] = {"error": str(exc)}
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(report.finite(result), indent=1))
        outputs.append((result, path, plots.draw(result, args.out)))
        wrong += [f"{name}/{policy}" for policy, runs in result["policies"].items() if not runs["verify"]["ok"]]
        if not dynet_baseline.ok(result.get("dynet", {})):
            wrong.append(f"{name}/dynet")
    progress.close()
    for result, path, figures in outputs:
        print(f"\n## {result['preset']}: {result['description']}  ({result['seconds']:.0f} s)\n")
        print(report.table(result))
        for line in report.target_lines(result):
            print(line)
        for line in dynet_baseline.lines(result["dynet"]) if "dynet" in result else []:
            print(line)
        for policy, runs in result["policies"].items():
            check = runs["verify"]
            print(f"answers {policy}: {check['checked']} checked, max abs error {check['max_abs_error']:.1e}"
                  f"{'' if check['ok'] else ' WRONG: ' + '; '.join(check['wrong'])}")
        print(f"wrote {path}" + "".join(f", {figure}" for figure in figures))
    if wrong:
        print(f"answers differ from the reference model: {', '.join(wrong)}", file=sys.stderr)
    if args.preset == "all" and not overload.main(args.quick, args.out):
        wrong.append("overload")
    if args.preset == "all" and not chaos.main(args.quick, args.out):
        wrong.append("chaos")
    if args.preset == "all":
        results_page.write(args.out, args.out / "results.md")
        print(f"wrote {args.out / 'results.md'}")
    return 1 if wrong else 0


def _write_json(out: Path, preset: str, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{preset}.json").write_text(json.dumps(report.finite(result), indent=1))


if __name__ == "__main__":
    sys.exit(main())
