"""A plugin module that cannot even be imported (used by test_dispatch)."""

raise ImportError("this plugin needs a library that is not installed")
