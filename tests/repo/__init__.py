"""The repository itself: its docs, the layering of imports, the generated protobuf code, the wire format."""
