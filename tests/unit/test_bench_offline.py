"""``tandem bench offline``'s batched run on a tiny model: its steps split into those that computed prompt tokens
and those that only decoded, as the scheduler ran them."""

from __future__ import annotations

from engine import Engine
from tandem.bench.offline import Workload, format_phases, tandem_batch_run


def test_a_chunked_prompt_step_with_decode_rows_counts_as_prefill(tiny_llama):
    # 30 prompt tokens at 16 a step: step 1 the first prompt whole and 6 of the second, step 2 the first's decode
    # row beside the second's last 14; then the first needs 2 more tokens and the second 1: 2 decode-only steps.
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64, max_num_batched_tokens=16)
    run = tandem_batch_run(engine, Workload([[5] * 10, [7] * 20], [4, 2]))
    assert (run.prefill_steps, run.decode_steps) == (2, 2)
    assert run.prefill_steps_s > 0 and run.decode_steps_s > 0
    assert run.prefill_steps_s + run.decode_steps_s <= 6 / run.out_tok_s, "the steps are part of the wall time"
    assert engine.num_free_blocks == engine.num_total_blocks


def test_prompts_in_one_step_leave_one_decode_step_per_further_token(tiny_llama):
    engine = Engine.from_model(str(tiny_llama), num_kv_blocks=64)
    run = tandem_batch_run(engine, Workload([[5] * 10, [7] * 20, [9] * 3], [4, 2, 7]))
    assert (run.prefill_steps, run.decode_steps) == (1, 6)


def test_the_phase_table_reads_each_phase_against_its_bound():
    row = {"dtype": "bfloat16", "tandem_batch_steps": {"prefill_steps": 8, "prefill_steps_s": 9.3, "decode_steps": 253,
                                                       "decode_steps_s": 8.27},
           "workload_roofline": {"prefill_s": 8.09, "decode_s": 5.41},
           "prefill_fraction_of_roofline": 8.09 / 9.3, "decode_fraction_of_roofline": 5.41 / 8.27}
    assert format_phases([row])[2] == "| bfloat16 | 8 | 9.30 | 8.09 | 87% | 253 | 8.27 | 5.41 | 65% |"
