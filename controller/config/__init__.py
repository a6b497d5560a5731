"""The settings: the root object, the control API's and the models file's parts, placement."""
