"""plot.py: real runs in, one PNG, PDF or SVG out, each line named by the flags that differ; bad input is one line."""

import json

import pytest

import common
import grpo
import plot
from conftest import script_args, tiny_args


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    for group_size in (2, 4):
        grpo.train(tiny_args(grpo, model=tiny_model_dir, num_steps=2, group_size=group_size, max_new_tokens=6,
                             eval_size=2, test_size=4, runs_dir=str(root)))
    return root


def write_run(root, name, args, rows):
    """A run folder written by hand: args.json (any JSON, or raw text) and metrics.jsonl rows (dicts or raw lines)."""
    run = root / name
    run.mkdir(parents=True)
    (run / "args.json").write_text(args if isinstance(args, str) else json.dumps(args))
    (run / "metrics.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return run


def legend(fig):
    """The figure-level legend's labels, in order."""
    return [text.get_text() for text in fig.legends[0].get_texts()]


GRPO = dict(script="grpo", learning_rate=3e-5, seed=1, exp_name="grpo", task_min_numbers=2, task_max_numbers=2,
            task_max_value=20, task_operators="+-")


def test_runs_are_plotted_and_labelled_by_the_flags_that_differ(two_runs, tmp_path):
    out = plot.plot(script_args(plot, runs=[str(two_runs)], out=str(tmp_path / "fig.png"), smooth=0.5))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    runs = plot.find_runs([str(two_runs)])
    assert sorted(plot.labels(plot.group_by_seed(runs))) == ["grpo group_size=2", "grpo group_size=4"]
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
    (dict(out="fig.jpg"), "--out='fig.jpg' is not allowed: a file name ending in .png, .pdf or .svg"),
])
def test_bad_input_is_a_one_line_error(flags, message, two_runs, tmp_path):
    args = script_args(plot, **{"runs": [str(two_runs)], "out": str(tmp_path / "f.png"), **flags})
    with pytest.raises(common.ConfigError, match=message):
        plot.plot(args)


def test_non_numeric_values_and_a_non_object_args_json_are_skipped(tmp_path):
    rows = [{"step": 0, "charts/reward": "abc"}, {"step": 1, "charts/reward": [1]},
            {"step": 2, "charts/reward": 0.5}, {"step": "3", "charts/reward": 1.0},
            {"step": 4, "charts/reward": True}, {"step": 5, "charts/reward": 1e999},
            {"step": 6, "charts/reward": {"a": 1}}, {"step": 7, "charts/reward": None}, "[1, 2]", "{" * 100000]
    run = write_run(tmp_path / "runs", "a", [1, 2], rows)
    write_run(tmp_path / "runs", "b", "not json", [{"step": 0, "charts/reward": 0.1}])
    kept = [None, None, 0.5, None, float("inf"), None, None]  # step "3" is no step; inf is a number, never drawn
    assert [r.get("charts/reward") for r in plot.read_rows(run)] == kept
    assert plot.load_args(run) == {}
    out = plot.plot(script_args(plot, runs=[str(tmp_path / "runs")], out=str(tmp_path / "f.png")))
    assert open(out, "rb").read(4) == b"\x89PNG"


@pytest.mark.parametrize("out,message", [
    ("folder.png", "a file name, not a folder"),
    ("missing/f.png", "a file in an existing folder"),
    ("/proc/plot-test.png", "it cannot be written"),
    ("x" * 300 + ".png", "it cannot be written"),  # name too long
    ("f.jpg", "a file name ending in .png, .pdf or .svg"),
    ("f", "a file name ending in .png, .pdf or .svg"),
    ("link.png", "a file, not a symbolic link"),  # dangling: opening it would create outside.png
])
def test_a_bad_out_is_refused_before_plotting(out, message, tmp_path, monkeypatch):
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "link.png").symlink_to(tmp_path / "outside.png")
    write_run(tmp_path, "a", GRPO, [{"step": 0, "charts/reward": 0.1}])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plot, "figure", lambda args: pytest.fail("plotted before checking --out"))
    with pytest.raises(common.ConfigError, match=f"^--out=.* is not allowed: {message}"):
        plot.plot(script_args(plot, runs=[str(tmp_path / "a")], out=out))
    assert not (tmp_path / "missing").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "folder.png", "link.png"]


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".pdf", b"%PDF"), (".SVG", b"<?xml")])
def test_the_suffix_of_out_picks_the_format(suffix, magic, tmp_path):
    write_run(tmp_path, "a", GRPO, [{"step": 0, "charts/reward": 0.1}, {"step": 1, "charts/reward": 0.2}])
    out = plot.plot(script_args(plot, runs=[str(tmp_path / "a")], out=str(tmp_path / f"fig{suffix}")))
    data = open(out, "rb").read()
    assert data.startswith(magic) and (suffix != ".SVG" or b"<svg" in data[:1000])


def test_every_run_is_in_the_legend_even_without_an_eval_accuracy_panel(tmp_path):
    write_run(tmp_path, "evals", GRPO, [{"step": 0, "charts/eval_accuracy": 0.1, "charts/reward": 0.2}])
    write_run(tmp_path, "no_evals", {**GRPO, "learning_rate": 1e-5}, [{"step": 0, "charts/reward": 0.3}])
    fig = plot.figure(script_args(plot, runs=[str(tmp_path)]))
    assert legend(fig) == ["grpo learning_rate=1e-05", "grpo learning_rate=3e-05"]  # by value


def test_seeds_of_one_setting_are_one_mean_line_with_a_min_max_band(tmp_path):
    for seed, reward in ((1, 0.1), (2, 0.2), (3, 0.6)):
        write_run(tmp_path, f"grpo__{seed}", {**GRPO, "seed": seed, "exp_name": f"x{seed}"},
                  [{"step": s, "charts/reward": reward * s} for s in range(3)] + [{"step": 3, "charts/reward": seed}])
    write_run(tmp_path, "other", {**GRPO, "learning_rate": 1e-5}, [{"step": 0, "charts/reward": 0.5}])
    (tmp_path / "grpo__3" / "metrics.jsonl").write_text("".join(  # the third seed is still at step 2
        json.dumps({"step": s, "charts/reward": 0.6 * s}) + "\n" for s in range(3)))
    fig = plot.figure(script_args(plot, runs=[str(tmp_path)], metrics=["charts/reward"]))
    assert legend(fig) == ["grpo learning_rate=1e-05", "grpo learning_rate=3e-05 (3 seeds: mean, band min-max)"]
    panel = fig.axes[0]
    mean = panel.lines[1]
    assert list(mean.get_xdata()) == [0, 1, 2] and list(mean.get_ydata()) == pytest.approx([0, 0.3, 0.6])
    band = panel.collections[0].get_paths()[0].vertices[:, 1]
    assert min(band) == pytest.approx(0) and max(band) == pytest.approx(1.2) and len(panel.collections) == 1


def test_a_seed_run_by_newer_code_with_more_logging_flags_is_still_a_seed_of_the_setting(tmp_path):
    """Flags that only say where or how a run's outputs are written (W&B entity, the dtype of final/) and the
    record of where --model's folder was (model_source) were added after the committed study runs; a new seed
    that records them belongs to the same mean line and band."""
    write_run(tmp_path, "grpo__1", {**GRPO, "seed": 1}, [{"step": 0, "charts/reward": 0.1}])
    write_run(tmp_path, "grpo__2", {**GRPO, "seed": 2, "wandb_entity": "", "final_dtype": "compute",
                                    "model_source": {"path": "/cache/warm-start", "warm_start": {"seed": 1}}},
              [{"step": 0, "charts/reward": 0.3}])
    assert plot.labels(plot.group_by_seed(plot.find_runs([str(tmp_path)]))) == ["grpo (2 seeds: mean, band min-max)"]
    write_run(tmp_path, "grpo__3", {**GRPO, "seed": 3, "learning_rate": 1e-5}, [{"step": 0, "charts/reward": 0.2}])
    assert len(plot.group_by_seed(plot.find_runs([str(tmp_path)]))) == 2  # a training flag still splits


def test_a_run_named_twice_is_one_run_and_one_seed_run_twice_is_two_lines_not_a_seed_spread(tmp_path):
    write_run(tmp_path, "a", GRPO, [{"step": 0, "charts/reward": 0.1}])
    assert plot.labels(plot.group_by_seed(plot.find_runs([str(tmp_path / "a"), str(tmp_path)]))) == ["grpo"]
    write_run(tmp_path, "b", GRPO, [{"step": 0, "charts/reward": 0.2}])  # same flags and seed: other code
    write_run(tmp_path, "c", {**GRPO, "seed": 2}, [{"step": 0, "charts/reward": 0.3}])
    groups = plot.group_by_seed(plot.find_runs([str(tmp_path)]))
    assert [[run.name for run in group] for group in groups] == [["a", "c"], ["b"]]
    assert plot.labels(groups) == ["grpo (a) (2 seeds: mean, band min-max)", "grpo (b)"]


def test_settings_are_ordered_by_the_values_of_the_flags_that_differ_not_by_folder_name(tmp_path):
    """Folders sort beta-0.0__ after beta-0.04__ ("_" after digits); the legend follows beta's value, scripts first."""
    for name, beta in (("beta-0.0075", 0.0075), ("beta-0.01", 0.01), ("beta-0.04", 0.04), ("beta-0.0", 0.0)):
        write_run(tmp_path, f"{name}__1__1", {**GRPO, "beta": beta}, [{"step": 0, "charts/reward": beta}])
    write_run(tmp_path, "z-dapo__1__1", {**GRPO, "script": "dapo", "beta": 0.5}, [{"step": 0, "charts/reward": 1}])
    write_run(tmp_path, "y-nan__1__1", {**GRPO, "beta": float("nan")}, [{"step": 0, "charts/reward": 1}])
    fig = plot.figure(script_args(plot, runs=[str(tmp_path)], metrics=["charts/reward"]))
    assert legend(fig) == ["dapo beta=0.5", "grpo beta=0.0", "grpo beta=0.0075", "grpo beta=0.01", "grpo beta=0.04",
                           "grpo beta=nan"]
    fig = plot.figure(script_args(plot, runs=[str(tmp_path / "y-nan__1__1"), str(tmp_path / "beta-0.04__1__1"),
                                              str(tmp_path / "beta-0.0__1__1")], metrics=["charts/reward"]))
    assert legend(fig) == ["grpo beta=0.0", "grpo beta=0.04", "grpo beta=nan"]  # the same order, named in any order


def test_accuracy_panels_show_the_baselines(tmp_path):
    rows = [{"step": 0, "charts/eval_accuracy": 0.1, "charts/eval_best_constant": 0.25,
             "charts/eval_uniform_guess": 0.05, "charts/reward": 0.1},
            {"step": 2, "charts/eval_accuracy": 0.4, "charts/eval_best_constant": 0.9,
             "charts/eval_uniform_guess": 0.9}]
    write_run(tmp_path, "a", GRPO, rows)
    fig = plot.figure(script_args(plot, runs=[str(tmp_path)], metrics=["charts/eval_accuracy", "charts/reward"]))
    accuracy, reward = fig.axes[:2]
    flat = {(line.get_linestyle(), tuple(line.get_ydata())) for line in accuracy.lines}
    assert {("--", (0.25, 0.25)), (":", (0.05, 0.05))} <= flat
    assert len(reward.lines) == 1
    assert legend(fig) == ["grpo", "best constant answer", "uniform guess"]
    other = {**GRPO, "task_operators": "+*"}  # another rung, other baselines: each in its line's colour
    write_run(tmp_path / "two", "c", other, [{**rows[0], "charts/eval_best_constant": 0.5}])
    fig = plot.figure(script_args(plot, runs=[str(tmp_path / "a"), str(tmp_path / "two" / "c")],
                                  metrics=["charts/eval_accuracy"]))
    dashed = {tuple(line.get_ydata()): line.get_color() for line in fig.axes[0].lines if line.get_linestyle() == "--"}
    colour = {name: h.get_color() for name, h in zip(legend(fig), fig.legends[0].legend_handles)}
    assert dashed == {(0.25, 0.25): colour["grpo 2 numbers ≤ 20, + -"], (0.5, 0.5): colour["grpo 2 numbers ≤ 20, + *"]}
    assert legend(fig)[2:] == ["best constant answer (in each line's colour)", "uniform guess"]
    write_run(tmp_path / "old", "d", other, [{"step": 0, "charts/eval_accuracy": 0.2}])  # logged no baselines
    fig = plot.figure(script_args(plot, runs=[str(tmp_path / "a"), str(tmp_path / "old" / "d")],
                                  metrics=["charts/eval_accuracy"]))
    assert legend(fig)[2:] == ["best constant answer (in each line's colour)", "uniform guess (in each line's colour)"]
    write_run(tmp_path / "none", "b", GRPO, [{"step": 0, "charts/eval_accuracy": 0.1}])  # none logged: no lines
    fig = plot.figure(script_args(plot, runs=[str(tmp_path / "none")]))
    assert len(fig.axes[0].lines) == 1 and legend(fig) == ["grpo"]


def test_panels_have_readable_titles_and_axis_labels(tmp_path):
    metrics = ["charts/eval_accuracy", "charts/accuracy", "losses/kl_ref", "losses/entropy", "losses/clipfrac",
               "charts/response_length", "charts/reward", "charts/custom"]
    write_run(tmp_path, "a", GRPO, [{"step": 0, **{m: 0.5 for m in metrics}}])
    fig = plot.figure(script_args(plot, runs=[str(tmp_path)], metrics=metrics))
    assert [panel.get_title() for panel in fig.axes[:8]] == [
        "Held-out greedy accuracy", "Training accuracy", "KL to the reference", "Entropy (nats/token)",
        "Clip fraction", "Response length (tokens)", "Reward", "charts/custom"]
    assert {panel.get_xlabel() for panel in fig.axes[:8]} == {"training step"}
    assert [panel.get_ylabel() for panel in fig.axes[:8]] == [
        "share of held-out tasks solved", "share of completions correct", "nats per token (k3 estimate)",
        "nats per token", "share of tokens clipped", "tokens per completion", "mean reward", ""]


def test_the_rung_all_runs_share_is_in_the_title_and_a_mixed_one_is_not(tmp_path):
    write_run(tmp_path / "same", "a", {**GRPO, "beta": 0.01}, [{"step": 0, "charts/reward": 0.1}])
    write_run(tmp_path / "same", "b", {**GRPO, "beta": 0.04}, [{"step": 0, "charts/reward": 0.1}])
    fig = plot.figure(script_args(plot, runs=[str(tmp_path / "same")], title="Fig. 6"))
    assert fig.get_suptitle() == "Fig. 6: 2 numbers ≤ 20, + -" and legend(fig) == ["grpo beta=0.01",
                                                                                          "grpo beta=0.04"]
    write_run(tmp_path / "mixed", "a", GRPO, [{"step": 0, "charts/reward": 0.1}])
    write_run(tmp_path / "mixed", "b", {**GRPO, "task_operators": "+-*"}, [{"step": 0, "charts/reward": 0.1}])
    fig = plot.figure(script_args(plot, runs=[str(tmp_path / "mixed")], title="Fig. 6"))
    assert fig.get_suptitle() == "Fig. 6" and legend(fig) == ["grpo 2 numbers ≤ 20, + -",
                                                                     "grpo 2 numbers ≤ 20, + - *"]
    write_run(tmp_path / "foreign", "a", {"script": "grpo"}, [{"step": 0, "charts/reward": 0.1}])
    assert plot.figure(script_args(plot, runs=[str(tmp_path / "foreign")])).get_suptitle() == ""


def test_task_settings_are_named_as_rungs_and_other_flags_as_name_value(tmp_path):
    write_run(tmp_path, "r1", {**GRPO, "beta": 0.04}, [{"step": 0, "charts/reward": 0.1}])
    write_run(tmp_path, "r2", {**GRPO, "task_min_numbers": 3, "task_max_numbers": 4, "task_max_value": 99,
                               "task_operators": "+-*/", "beta": 0.1}, [{"step": 0, "charts/reward": 0.1}])
    write_run(tmp_path, "r3", {**GRPO, "beta": 0.01}, [{"step": 0, "charts/reward": 0.1}])
    runs = plot.find_runs([str(tmp_path)])
    assert plot.labels(plot.group_by_seed(runs)) == ["grpo 2 numbers ≤ 20, + -, beta=0.04",
                                                     "grpo 3-4 numbers ≤ 99, + - * /, beta=0.1",
                                                     "grpo 2 numbers ≤ 20, + -, beta=0.01"]
    assert plot.labels(plot.group_by_seed(runs[:1] + runs[2:])) == ["grpo beta=0.04", "grpo beta=0.01"]


def test_a_kl_to_a_reference_that_was_never_loaded_is_not_drawn(tmp_path):
    rows = [{"step": s, "losses/kl_ref": 0.0, "charts/reward": 0.1 * s} for s in (1, 2)]
    write_run(tmp_path, "dapo", {**GRPO, "script": "dapo", "beta": 0.0}, rows)  # what older code logged at beta 0
    write_run(tmp_path, "grpo", {**GRPO, "beta": 0.01}, rows)
    fig = plot.figure(script_args(plot, runs=[str(tmp_path)], metrics=["losses/kl_ref", "charts/reward"]))
    assert [len(panel.lines) for panel in fig.axes] == [1, 2] and legend(fig) == ["dapo beta=0.0", "grpo beta=0.01"]


def test_forty_runs_get_distinct_colour_and_style_pairs_none_a_baselines_and_a_warning(tmp_path, capsys):
    for i in range(40):
        write_run(tmp_path, f"run{i:02d}", {**GRPO, "learning_rate": i}, [{"step": 0, "charts/reward": i / 40}])
    fig = plot.figure(script_args(plot, runs=[str(tmp_path)], metrics=["charts/reward"]))
    handles = fig.legends[0].legend_handles
    assert len({(h.get_color(), h.get_linestyle()) for h in handles}) == 40 == len(legend(fig))
    assert len({h.get_color() for h in handles}) == 20
    assert not {h.get_linestyle() for h in handles} & {dash for dash, _ in plot.BASELINES.values()}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "40 lines per panel" in err and "fewer runs" in err
    fig = plot.figure(script_args(plot, runs=[str(tmp_path / f"run{i:02d}") for i in range(20)],
                                  metrics=["charts/reward"]))
    assert capsys.readouterr().err == ""
