"""plot.py: real runs in, one PNG out, each line named by the flags that differ."""

import pytest

import common
import grpo
import plot


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    for group_size in (2, 4):
        grpo.train(grpo.Args(model=tiny_model_dir, num_steps=2, prompts_per_step=2, group_size=group_size,
                             max_new_tokens=6, eval_size=2, test_size=4, runs_dir=str(root), num_minibatches=1))
    return root


def test_runs_are_plotted_and_labelled_by_the_flags_that_differ(two_runs, tmp_path):
    out = plot.plot(plot.Args(runs=[str(two_runs)], out=str(tmp_path / "fig.png"), smooth=0.5))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    runs = plot.find_runs([str(two_runs)])
    assert sorted(plot.labels(runs)) == ["grpo group_size=2", "grpo group_size=4"]
    rows = plot.read_rows(runs[0])
    assert [r["step"] for r in rows] == [0, 1, 2] and "charts/eval_accuracy" in rows[0]


def test_a_torn_last_line_is_skipped(two_runs, tmp_path):
    run = plot.find_runs([str(two_runs)])[0]
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "charts/rew')  # a kill mid-write
    assert [r["step"] for r in plot.read_rows(run)] == [0, 1, 2]


def test_smoothing_is_tensorboards_debiased_average():
    assert plot.ema([5.0, 5.0, 5.0], 0.9) == pytest.approx([5.0, 5.0, 5.0])  # no pull towards 0 at the start
    assert plot.ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])


@pytest.mark.parametrize("flags,message", [
    (dict(runs=["/nonexistent"]), "no metrics.jsonl"),
    (dict(metrics=["charts/nothing"]), "no run logged any of them"),
    (dict(smooth=1.0), "smooth"),
    (dict(out="fig.pdf"), "a .png file name"),
])
def test_bad_input_is_a_one_line_error(flags, message, two_runs, tmp_path):
    args = plot.Args(**{"runs": [str(two_runs)], "out": str(tmp_path / "f.png"), **flags})
    with pytest.raises(common.ConfigError, match=message):
        plot.plot(args)
