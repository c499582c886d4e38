"""The vLLM adapter. ``kv_connector_module_path: kvxfer.connector`` loads
``KvxferConnector`` from here. Only ``kvxfer.connector.connector`` imports vLLM, and only
when ``KvxferConnector`` is first looked up, so the vLLM-free pieces beside it
(``params``, ``scheduler``, ``worker``, ``layout``, ``shm_pool``) import without vLLM."""

from typing import Any

__all__ = ["KvxferConnector", "KvxferConnectorMetadata", "KvxferStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvxfer.connector import connector

        return getattr(connector, name)
    raise AttributeError(name)
