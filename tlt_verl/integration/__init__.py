"""verl integration: the plugin verl loads, start-up checks, and (later) the TLT trainer hook."""
