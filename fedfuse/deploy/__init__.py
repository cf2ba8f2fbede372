"""Operations: what a real deployment's SuperLink and SuperNodes read (certificates, keys)."""
