"""The tests' one toolbox: real vLLM servers (`engines`), tiny seeded models (`models`), and
waiting on a record's changes (`wait`). Fixtures stay in the conftest files; what a test
imports comes from here (a conftest is never imported as a module)."""
