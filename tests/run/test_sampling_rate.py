"""dp.sampling_rate: q fixed in the config (the engine's plan, widedp.run.trainers.private)."""

from tiny_corpus import data_section

from widedp.cli import main


def test_a_fixed_sampling_rate_far_from_b_over_n_warns(tmp_path, capsys):
    """dp.sampling_rate fixes q; when q·N is far from train.batch_size (the noise's denominator) the run says so."""
    cfg = tmp_path / "c.yaml"
    for q, warns in ((0.5, True), (None, False)):
        rate = "" if q is None else f", sampling_rate: {q}"
        cfg.write_text(f"""
{data_section(tmp_path, splits='[0.5, 0.25, 0.25]')}
model: {{dim: 4, tied: false}}
train: {{epochs: 1, max_steps: 2, batch_size: 50, optimizer: sgd, lr: 0.1, eval_max_samples: 20}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {{name: all}}{rate}}}
""")
        capsys.readouterr()
        assert main(["train", str(cfg), "--out", str(tmp_path / f"run{q}"), "--no-progress"]) == 0
        err = capsys.readouterr().err
        assert ("dp.sampling_rate 0.5 draws" in err and "batch_size (the noise's denominator) is 50" in err) == warns
