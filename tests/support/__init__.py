"""What the tests share, a module for each thing it serves; fixtures stay in conftest.py."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
