"""Media decoding, encoder towers and the encoder cache (epd.encoders)."""
