"""``tandem generate --local``: the engine in this process, streaming to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from engine import Engine, SamplingParams
from tokenizer_svc.tokenizer import IncrementalDetokenizer, TextTokenizer


def generate_local(args: argparse.Namespace) -> int:
    from common.engine_args import engine_config
    from tandem.client import structured_output

    config = engine_config(args)
    tokenizer = TextTokenizer(config.model)
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        structured=structured_output(args),
    )
    engine = Engine(config)
    request_id = engine.add_request(prompt_ids, params)
    detok = IncrementalDetokenizer(tokenizer)
    start = time.perf_counter()
    first = None
    n = 0
    reason = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            first = first or time.perf_counter()
            n += len(out.new_token_ids)
            sys.stdout.write(detok.push(out.new_token_ids))
            sys.stdout.flush()
            reason = out.finish_reason
    sys.stdout.write(detok.flush() + "\n")
    sys.stdout.flush()
    end = time.perf_counter()
    ttft = (first - start) * 1000 if first else float("nan")
    tps = (n - 1) / (end - first) if first and n > 1 else float("nan")
    print(f"[{n} tokens, finish={reason}, ttft {ttft:.0f} ms, {tps:.1f} tok/s decode]", file=sys.stderr)
    return 0
