"""Long videos, file to file: PyAV I/O, scene cuts, a resumable work folder and the streaming upscale."""
