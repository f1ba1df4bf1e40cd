"""The ``capctl`` admin command line."""
