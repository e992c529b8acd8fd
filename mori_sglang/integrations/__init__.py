"""Framework integrations: each subpackage plugs the op into one serving framework.

Each one registers through its framework's own plugin entry point (declared in ``pyproject.toml``), so
users install mori-sglang next to a stock framework and change no code. Importing this package imports
no framework.
"""
