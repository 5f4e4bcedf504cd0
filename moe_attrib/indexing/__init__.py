"""The on-disk gradient index: building it (a consumer of the collection loop), its files and manifest,
and streaming its rows to a device."""
