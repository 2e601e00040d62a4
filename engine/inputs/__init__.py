"""What a request's items become before the forward pass: texts tokenized, images decoded and
preprocessed, each tagged with its modality.
"""
