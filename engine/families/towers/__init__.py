"""Two towers (CLIP, SigLIP): texts and images into one space."""
