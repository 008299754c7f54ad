"""`flexicache bench speculative`, `speculative-check` and `speculative-verify` in smoke mode: a tiny random model, synthetic prompts with a
repeated span (prompt lookup finds candidates); the tables are written and speculative decoding's tokens are plain
greedy decoding's."""

from fc_hf.eval.bench import cli as bench


def test_speculative_suites_smoke(tmp_path):
    rc = bench.main(["speculative", "speculative-check", "speculative-verify", "--smoke", "--spec-prompts", "1", "--check-prompts", "1",
                     "--out", str(tmp_path)])
    assert rc == 0
    speed = (tmp_path / "speculative.md").read_text()
    for row in ("| dense | plain |", "| dense | prompt lookup 4 |", "| flexicache | prompt lookup 4 |"):
        assert row in speed
    assert speed.count("| 1/1 |") == 2  # prompt lookup gave plain decoding's tokens, dense and FlexiCache
    check = (tmp_path / "speculative_check.md").read_text().splitlines()[-1]
    assert check.startswith("| tiny") and check.count("1/1") == 6, check
    verify = (tmp_path / "speculative_verify.md").read_text().splitlines()
    assert [row.split(" | ")[0] for row in verify if row[:3] in ("| 1", "| 5")] == ["| 1", "| 5"]  # T = 1 and 4 + 1
    assert verify[-2].split(" | ")[3] == "1.00"  # T = 1 against itself
