"""Fixtures shared by the service tests: the TEI and Cohere doors' server."""

from tests.service.doors_server import doors

__all__ = ["doors"]
