"""The `sluice` command: `sluice serve`, `sluice generate "prompt"`, `sluice bench ...`.

Every config.toml key is a flag of serve (engine and server keys) and generate (engine keys), resolved as the
server resolves them (web/config_flags.py). `sluice bench` hands its arguments to the load generator.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import fields

from engine.sampling_params import SamplingParams
from web.config_flags import add_config_flags, config_from_args
from web.start_signals import signals_stop_the_start

USAGE = """sluice <command> [flags]

commands:
  serve      run the OpenAI-compatible server (and the chat page at /)
  generate   generate once from a prompt, offline, streaming to the terminal
  bench      measurements: the load generator and the other modes (python -m bench)

`sluice <command> --help` lists each command's flags with their defaults."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        signals_stop_the_start()  # from the server's imports on (web/start_signals.py)
        from web.server import main as serve_main

        return serve_main(rest, prog="sluice serve")
    if command == "generate":
        return generate_main(rest)
    if command == "bench":
        from bench.modes import main as bench_main

        return bench_main(rest, prog="sluice bench")
    print(f"sluice: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


# ---- generate ---------------------------------------------------------------------------------------------
def generate_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice generate",
        description="Generate once from a prompt with the offline engine (no server), printing text as it "
        "comes. Instruct models get the prompt through their chat template unless --raw is given.",
    )
    parser.add_argument("prompt", help="the prompt; '-' reads it from standard input")
    params = SamplingParams()
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens to generate at most (default: 256)")
    for name, kind, meaning in (
        ("temperature", float, "0 = greedy"),
        ("top_p", float, "sample from the most likely tokens holding this much probability"),
        ("top_k", int, "sample from the k most likely tokens; -1 = off"),
        ("min_p", float, "drop tokens less likely than min_p times the most likely one"),
    ):
        default = getattr(params, name)
        metavar = "N" if kind is int else "X"
        sampling.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, metavar=metavar,
                              help=f"{meaning} (default: {default})")  # fmt: skip
    sampling.add_argument("--seed", type=int, metavar="N", help="for a repeatable sample (default: none)")
    sampling.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    prompt_form = parser.add_argument_group("prompt")
    prompt_form.add_argument("--system", metavar="TEXT", help="a system message (chat template only)")
    prompt_form.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    prompt_form.add_argument("--stats", action="store_true", help="print TTFT, tokens/s and the finish reason")
    add_config_flags(parser, sections=("engine",), argv=argv)
    return parser


def generate_main(argv: Sequence[str]) -> int:
    parser = generate_parser(argv)
    args = parser.parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:  # a mistake, not a question: said before the model loads
        parser.error("the prompt is empty" + (" (nothing came on standard input)" if args.prompt == "-" else ""))
    try:
        config = config_from_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as error:
        parser.error(str(error))
    from engine.llm import LLM  # torch: imported only when generating

    try:
        llm = LLM(**{f.name: getattr(config.engine, f.name) for f in fields(config.engine)})
    except (ValueError, OSError) as error:  # the loader's refusals and a path that is not there: no traceback
        print(f"sluice generate: the model did not load: {error}", file=sys.stderr)
        return 1
    use_chat = not args.raw and bool(llm.tokenizer.chat_template)
    if use_chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        request: str | list[dict[str, str]] = [*messages, {"role": "user", "content": prompt}]
    elif args.system:
        parser.error("--system needs the chat template (drop --raw)")
    else:
        request = prompt
    start = time.perf_counter()
    first_token_at = last_token_at = None
    num_tokens, finish_reason = 0, None
    try:
        for delta in llm.stream(request, params):
            if delta.new_token_ids:
                last_token_at = time.perf_counter()
                first_token_at = first_token_at or last_token_at
                num_tokens += len(delta.new_token_ids)
            sys.stdout.write(delta.text_delta)
            sys.stdout.flush()
            finish_reason = delta.finish_reason
    except KeyboardInterrupt:
        finish_reason = "interrupted"
    except ValueError as error:
        print(f"sluice generate: {error}", file=sys.stderr)
        return 2
    print(flush=True)
    if args.stats and first_token_at is not None and last_token_at is not None:
        rate = (num_tokens - 1) / (last_token_at - first_token_at) if num_tokens > 1 else 0.0
        print(f"[TTFT {(first_token_at - start) * 1000:.0f} ms · {rate:.1f} tok/s · {num_tokens} tokens · "
              f"finish: {finish_reason}]", file=sys.stderr)  # fmt: skip
    return 130 if finish_reason == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
