import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pack_import import import_pack  # noqa: E402

import_pack()  # makes `import seedvr2bw.<sub>` work in every test
sys.path.insert(0, str(ROOT / "tests"))  # shared test helpers (comfy_env, test_training_helpers)
DATA = Path(__file__).resolve().parent / "data"
