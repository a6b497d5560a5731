"""The HTTP edge: the control API and the OpenAI gateway, their guard, error answers and shapes."""
