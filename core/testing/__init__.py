"""polyspec's conformance suite, shipped with the package.

Run it against any installed backend plugin::

    pytest --pyargs polyspec.testing --polyspec-backend NAME

Tests skip only by capability, and print the capability that made them skip.
"""
