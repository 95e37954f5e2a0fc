"""resume_margins.py finds the draw that flipped in the fault test's failover (its prompts then, seed 6; base
10000, stream 16's token 22 lay 1.2e-6 from a CDF boundary) and the margins the test now relies on (prompt seed
10, top-k 8, base 44000; its greedy streams' top-two gaps)."""

from loadtest import resume_margins

FIRST_18_STREAMS = ["--num-streams", "18", "--resume-points", "4"]  # 9 streams of each kind, resumed at token 4


def test_reports_the_draw_that_flipped_when_its_stream_resumed(capsys):
    report = resume_margins.main([*FIRST_18_STREAMS, "--prompt-seed", "6", "--seed-base", "10000"])
    assert report["closest_draw_at"] == {"stream": 16, "token": 22}
    assert report["closest_draw"] < report["shift_max"]
    assert report["flips"] == [{"stream": 16, "resumed_at": 4, "differs_at": 22}]
    assert report["num_resumed_draws"] == 8 * 20 + 18  # the flipped stream's draws count up to its flip


def test_top_k_8_keeps_every_draw_far_from_a_boundary():
    report = resume_margins.main([*FIRST_18_STREAMS, "--seed-base", "44000", "--top-k", "8"])
    assert report["flips"] == [] and report["num_resumed_draws"] == 9 * 20
    assert report["closest_over_max_shift"] > 10


def test_greedy_streams_report_their_top_two_gaps():
    report = resume_margins.main([*FIRST_18_STREAMS, "--greedy"])  # streams 1, 3... 17
    assert report["flips"] == [] and report["num_resumed_draws"] == 9 * 20
    assert report["closest_over_max_shift"] > 10
