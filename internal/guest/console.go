package guest

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// OpenConsole opens the tty at path (the virtio console /dev/hvc0) for the
// agent's stream: non-blocking, so that Go's poller serves it and read
// deadlines work; without becoming the controlling terminal; in raw mode, so
// that the line discipline neither echoes nor translates bytes. Keep the
// file open for the agent's lifetime: the hvc driver resets termios on the
// last close.
func OpenConsole(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open console %s: %w", path, err)
	}
	if err := makeRaw(fd); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("console %s raw mode: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// makeRaw applies cfmakeraw(3) to the tty fd.
func makeRaw(fd int) error {
	t, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return err
	}
	t.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	t.Oflag &^= unix.OPOST
	t.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	t.Cflag &^= unix.CSIZE | unix.PARENB
	t.Cflag |= unix.CS8
	t.Cc[unix.VMIN] = 1
	t.Cc[unix.VTIME] = 0
	return unix.IoctlSetTermios(fd, unix.TCSETS, t)
}
