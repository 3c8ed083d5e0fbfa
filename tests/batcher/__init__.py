"""The batcher's tests. A package, so that its conftest (the session's shared engines) does not
take the place of tests/conftest.py as the module ``conftest`` that other tests import from."""
