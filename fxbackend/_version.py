"""The package's version, in a module of its own: modules of the package that record it (a
saved plan's producer) import it from here, not from the package root, which imports them."""

__version__ = "0.1.0"
