"""The `moe-attrib` command: its parser and printing, the terminal and HTML report, the demo and `info`."""
