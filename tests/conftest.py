import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pack_import import import_pack  # noqa: E402

import_pack()  # makes `import seedvr2bw.<sub>` work in every test
sys.path.insert(0, str(ROOT / "tests"))  # shared test helpers (comfy_env, test_training_helpers)
DATA = Path(__file__).resolve().parent / "data"

import pytest  # noqa: E402

from seedvr2bw.optimization.runtime import knobs  # noqa: E402


@pytest.fixture(autouse=True)
def knobs_follow_the_environment(monkeypatch):
    """Knobs are parsed once per process: each test starts from the environment as it is, and a SEEDVR2BW_
    variable a test sets or removes through ``monkeypatch`` is read again at once."""
    knobs.reset()
    setenv, delenv = monkeypatch.setenv, monkeypatch.delenv

    def set_and_reset(*args, **kwargs):
        setenv(*args, **kwargs)
        knobs.reset()

    def del_and_reset(*args, **kwargs):
        delenv(*args, **kwargs)
        knobs.reset()

    monkeypatch.setenv, monkeypatch.delenv = set_and_reset, del_and_reset
    yield
    knobs.reset()
