"""``python -m widedp.native``: build the fused CPU kernels now (scripts/setup_env.sh runs this once)."""

import sys
import time

from widedp import native

t0 = time.perf_counter()
try:
    path = native.build()
    native.available()
except Exception as e:  # the kernels are optional: say why, exit non-zero, never a traceback
    print(f"[widedp] fused CPU kernels not built ({e}); widedp will use the PyTorch path", file=sys.stderr)
    sys.exit(1)
print(f"[widedp] fused CPU kernels ready: {path} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
