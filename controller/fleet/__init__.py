"""Who is awake: the swap and its device and host policies, admission, idle sleep, supervision."""
