"""Tree ensembles at batch 1024: scikit-learn forests exported with skl2onnx.

    python -m benchmarks.trees                   # 1 thread, 7 alternating passes
    python -m benchmarks.trees --batch 1024 --threads 2

Three models trained here on a synthetic task (20 features, 3 classes; nothing is
downloaded), exported with ``zipmap`` off: a random forest classifier (100 trees,
depth 10), a gradient-boosting classifier (100 rounds of depth-3 trees per class) and
a random forest regressor (100 trees, depth 10). Each pass times keel's cpu backend
and onnxruntime back to back on the same batch; the ratio is the median over passes
of keel's time over onnxruntime's (below 1.0 keel is faster), as
``benchmarks/decode.py`` reports it. Needs scikit-learn and skl2onnx (the ``test``
extra). Writes ``benchmarks/results/trees-<stamp>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.decode import RESULTS, _alternate, _load_average, _repeat, _runners, _write


def _models() -> dict[str, bytes]:
    from skl2onnx import to_onnx
    from sklearn.datasets import make_classification
    from sklearn.ensemble import (
        GradientBoostingClassifier,
        RandomForestClassifier,
        RandomForestRegressor,
    )

    x, y = make_classification(n_samples=4000, n_features=20, n_informative=12,
                               n_classes=3, random_state=0)
    x = x.astype(np.float32)
    fitted = {
        "random_forest_classifier": RandomForestClassifier(
            n_estimators=100, max_depth=10, random_state=0).fit(x, y),
        "gradient_boosting_classifier": GradientBoostingClassifier(
            n_estimators=100, max_depth=3, random_state=0).fit(x, y),
        "random_forest_regressor": RandomForestRegressor(
            n_estimators=100, max_depth=10, random_state=0).fit(x, y.astype(np.float32)),
    }
    return {name: to_onnx(model, x[:1], options={"zipmap": False} if "classifier" in name
                          else None).SerializeToString() for name, model in fitted.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--pass-seconds", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    before = _load_average()
    feeds = {"X": np.random.default_rng(1).standard_normal((args.batch, 20)).astype(np.float32)}
    rows: list[dict[str, Any]] = []
    for name, model in _models().items():
        keel_run, ort_run = _runners(model, args.threads)
        for got, want in zip(keel_run(feeds), ort_run(feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        rows.append(_alternate(f"{name}_b{args.batch}", args.passes,
                               lambda run, _: _repeat(run, feeds, args.pass_seconds),
                               keel_run, ort_run))
    _write(args, rows, before, "trees", batch=args.batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
