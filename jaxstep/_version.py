"""jaxstep's version: its own module, so that any layer may read it without importing the
package root."""

__version__ = "0.1.0"
