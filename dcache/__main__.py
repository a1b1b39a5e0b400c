"""`python -m dcache ...`: the `dcache` command line, for environments whose scripts folder is not on PATH
(a notebook kernel, a venv used without activation)."""

from dcache.pipelines.cli import main

if __name__ == "__main__":
    main()
