// Package device opens the TPM a node attests with. It is the only place the
// node half of the TPM attestor learns where its TPM is, so the choice is
// configuration: the kernel's resource manager (/dev/tpmrm0, the default), a
// raw character device, or a TPM emulator's command socket (swtpm's
// "--server type=unixio" or "type=tcp"). The signer never imports it.
package device

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/google/go-tpm/tpm2/transport"
)

// DefaultPath is the TPM used when none is configured: the kernel's
// in-kernel resource manager, which flushes whatever a crashed client left
// loaded and lets several clients share the TPM.
const DefaultPath = "/dev/tpmrm0"

// maxResponse bounds a TPM message read from a socket; TPM responses are a
// few kilobytes at most (MAX_RESPONSE_SIZE is 4096 on most TPMs).
const maxResponse = 64 << 10

// Open opens the TPM named by spec:
//
//   - "" or a path: a character device (DefaultPath when empty); a path
//     that is a Unix socket is treated like "unix://path";
//   - "unix:///run/swtpm/sock": an emulator's command socket, raw TPM
//     commands over one stream (swtpm socket --server type=unixio);
//   - "tcp://127.0.0.1:2321": the same over TCP (swtpm socket --server
//     type=tcp). This is swtpm's protocol, not the Microsoft simulator's.
func Open(spec string) (transport.TPMCloser, error) {
	switch {
	case strings.HasPrefix(spec, "unix://"):
		return dial("unix", strings.TrimPrefix(spec, "unix://"))
	case strings.HasPrefix(spec, "tcp://"):
		return dial("tcp", strings.TrimPrefix(spec, "tcp://"))
	case strings.Contains(spec, "://"):
		return nil, fmt.Errorf("unsupported TPM address %q (want a device path, unix:// or tcp://)", spec)
	}
	path := spec
	if path == "" {
		path = DefaultPath
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("unable to open TPM: %w", err)
	}
	switch {
	case fi.Mode()&os.ModeSocket != 0:
		return dial("unix", path)
	case fi.Mode()&os.ModeDevice == 0:
		return nil, fmt.Errorf("unable to open TPM: %s is neither a device nor a socket", path)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("unable to open TPM: %w", err)
	}
	return transport.FromReadWriteCloser(f), nil
}

// Opener returns a function that opens spec, for tpm.NewAttestor.
func Opener(spec string) func() (transport.TPMCloser, error) {
	return func() (transport.TPMCloser, error) { return Open(spec) }
}

func dial(network, addr string) (transport.TPMCloser, error) {
	if addr == "" {
		return nil, fmt.Errorf("unable to open TPM: empty %s address", network)
	}
	conn, err := net.DialTimeout(network, addr, 10*time.Second)
	if err != nil {
		return nil, fmt.Errorf("unable to connect to TPM at %s://%s: %w", network, addr, err)
	}
	return &stream{conn: conn}, nil
}

// stream sends raw TPM commands over one connection and reads each response
// by the size in its header.
type stream struct {
	mu   sync.Mutex
	conn net.Conn
}

// Send implements transport.TPM.
func (s *stream) Send(cmd []byte) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == nil {
		return nil, errors.New("TPM connection is closed")
	}
	if _, err := s.conn.Write(cmd); err != nil {
		return nil, fmt.Errorf("unable to send TPM command: %w", err)
	}
	rsp, err := ReadMessage(s.conn)
	if err != nil {
		return nil, fmt.Errorf("unable to read TPM response: %w", err)
	}
	return rsp, nil
}

// ReadMessage reads one TPM command or response from r: a 10-byte header
// whose size field (bytes 2 to 5) counts the whole message, at most
// maxResponse.
func ReadMessage(r io.Reader) ([]byte, error) {
	hdr := make([]byte, 10)
	if _, err := io.ReadFull(r, hdr); err != nil {
		return nil, err
	}
	size := binary.BigEndian.Uint32(hdr[2:6])
	if size < 10 || size > maxResponse {
		return nil, fmt.Errorf("invalid size %d", size)
	}
	msg := make([]byte, size)
	copy(msg, hdr)
	if _, err := io.ReadFull(r, msg[10:]); err != nil {
		return nil, err
	}
	return msg, nil
}

// Close implements io.Closer.
func (s *stream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == nil {
		return nil
	}
	err := s.conn.Close()
	s.conn = nil
	return err
}
