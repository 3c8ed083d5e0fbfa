"""The version of enginekit: one place, read by the package, the build and every manifest."""

__version__ = "0.1.0"
