"""Where the tests find the repository and their data, wherever under tests/ a test lives."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
