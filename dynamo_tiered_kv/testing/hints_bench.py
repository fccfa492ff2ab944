"""Cost of ``plan_retention`` by directives and blocks: ``python -m dynamo_tiered_kv.testing.hints_bench``."""

from __future__ import annotations

import time

from dynamo_tiered_kv.hints import RetainDirective, plan_retention


def _time(directives: list[RetainDirective], prompt: int, output: int, reps: int) -> tuple[int, int, float]:
    t = time.perf_counter()
    for _ in range(reps):
        plan = plan_retention(directives, block_size=16, num_prompt_tokens=prompt, num_output_tokens=output, now=0.0)
    return plan.num_blocks, len(plan.ranges), (time.perf_counter() - t) / reps


def main() -> None:
    most = [RetainDirective(100 - i // 2, 126_000 * i, 126_000 * (i + 1), duration=60.0 * (128 - i))
            for i in range(127)] + [RetainDirective(1, covers_output=True)]
    typical = [RetainDirective(80, 0, 4000, duration=3600.0), RetainDirective(20, covers_output=True, duration=600.0)]
    cases = [(typical, 4000, 96, 2000), (typical, 4000, 16_000_000 - 4000, 2000),
             (most, 152, 8, 200), (most, 16_000_000 - 8, 8, 200)]
    for directives, prompt, output, reps in cases:
        blocks, ranges, sec = _time(directives, prompt, output, reps)
        print(f"directives={len(directives):>3} blocks={blocks:>9} ranges={ranges:>4} "
              f"plan_retention={sec * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
