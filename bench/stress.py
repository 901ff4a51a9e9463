"""--soak and --abuse runs: the server (the one at --url, or a Sluice started here), the run, its report."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench import abuse, proc, servers, soak
from bench.client import Target, discover_model
from bench.hostile import require_loopback


async def run(args: argparse.Namespace, stack: ExitStack) -> int:
    """--soak or --abuse against --url (its PID from --server-pid) or a Sluice server started here.
    Exit status 1 when the server did not hold up (growth, a death, missed /health target or failures)."""
    if args.url:
        _, port = require_loopback(args.url)
        root, pid = args.url, args.server_pid or proc.listening_pid(port)
        if pid is not None and args.server_pid is None:
            print(f"bench: the server at {args.url} is process {pid} (the one listening on port {port})", file=sys.stderr)
    else:
        port = servers.free_port()
        root = f"http://127.0.0.1:{port}"
        command = servers.sluice_command(port, args.sluice_model, args.sluice_arg)
        server = await servers.start_ready("sluice", command, Target("sluice", root), Path(args.log_dir), stack,
                                           args.startup_timeout)
        pid = server.process.pid
    target = Target(urlsplit(root).netloc, root, args.model)
    if target.model is None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            target = Target(target.name, root, await discover_model(client, target))

    def log(message: str) -> None:
        print(f"bench: {message}", file=sys.stderr)

    if args.soak:
        config = soak.SoakConfig(
            duration=args.duration or 600.0, concurrency=args.concurrency, endpoint=args.endpoint,
            warmup_concurrency=args.warmup_concurrency, warmup_prompt_tokens=args.warmup_prompt_tokens,
            warmup_output_tokens=args.warmup_output_tokens, block_size=args.block_size,
            prompt_tokens=args.prompt_tokens or soak.SoakConfig.prompt_tokens,
            output_tokens=args.output_tokens or soak.SoakConfig.output_tokens,
            long_output_tokens=args.long_output_tokens,
            never_read_seconds=args.never_read_seconds, request_timeout=min(args.timeout, 120.0),
            settle_seconds=args.settle_seconds, checkpoints=args.checkpoints, seed=args.seed)
        result = await soak.run_soak(target, pid, config, log)
        text, data, is_ok = soak.report(result), soak.to_json(result), result.is_clean
    else:
        config = abuse.AbuseConfig(duration=args.duration or 30.0, abusers=args.abusers, seed=args.seed,
                                   request_timeout=min(args.timeout, 60.0))
        result = await abuse.run_abuse(target, config, log)
        text, data = abuse.report(result), abuse.to_json(result)
        is_ok = data["meets_target"] and data["failures"] == 0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1))
        log(f"wrote {args.json}")
    print(text)
    return 0 if is_ok else 1
