package sniff

import (
	"fmt"
)

const (
	recordHandshake    = 0x16
	handshakeClientHi  = 1
	maxRecordLen       = 1 << 14 // TLSPlaintext.length bound
	extServerName      = 0x0000
	extECH             = 0xfe0d
	serverNameHostName = 0
)

func malformed(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrMalformed}, a...)...)
}

// decideTLS walks the handshake records at the start of buf, collecting the
// ClientHello (which may span records), and parses it when complete.
func decideTLS(buf []byte) (Result, bool, int) {
	var frags [][]byte // handshake bytes, slices of buf
	have := 0          // handshake bytes collected
	want := -1         // 4 + the ClientHello's length, once known
	off := 0
	for {
		if len(buf) < off+5 {
			need := off + 5
			if want >= 0 {
				need += want - have // the rest cannot take fewer bytes
			}
			return Result{Kind: TLS}, false, need
		}
		h := buf[off : off+5]
		if h[0] != recordHandshake {
			return Result{Kind: TLS, Err: malformed("record type %d before the ClientHello ended", h[0])}, true, 0
		}
		if h[1] != 3 || h[2] > 4 {
			if off == 0 {
				return Result{Kind: Unknown}, true, 0 // 0x16 then not a TLS version: not TLS
			}
			return Result{Kind: TLS, Err: malformed("record version %d.%d", h[1], h[2])}, true, 0
		}
		rl := int(h[3])<<8 | int(h[4])
		if rl == 0 || rl > maxRecordLen {
			return Result{Kind: TLS, Err: malformed("record length %d", rl)}, true, 0
		}
		if len(buf) < off+5+rl {
			// Ask for the whole record, or, if the ClientHello's length is
			// known, at least what it still needs (an early ErrTooLarge).
			need := off + 5 + rl
			if want >= 0 {
				need = max(need, off+5+(want-have))
			}
			return Result{Kind: TLS}, false, need
		}
		frags = append(frags, buf[off+5:off+5+rl])
		have += rl
		off += 5 + rl
		if want < 0 && have >= 4 {
			var hdr [4]byte
			gather(hdr[:], frags)
			if hdr[0] != handshakeClientHi {
				return Result{Kind: TLS, Err: malformed("first handshake message is type %d, not ClientHello", hdr[0])}, true, 0
			}
			want = 4 + (int(hdr[1])<<16 | int(hdr[2])<<8 | int(hdr[3]))
		}
		if want >= 0 && have >= want {
			var msg []byte
			if len(frags[0]) >= want {
				msg = frags[0][:want]
			} else {
				msg = make([]byte, want) // want <= have <= len(buf) <= max
				gather(msg, frags)
			}
			res := Result{Kind: TLS}
			res.Name, res.ECH, res.Err = parseClientHello(msg[4:])
			return res, true, 0
		}
	}
}

// gather fills dst from the start of the concatenation of frags.
func gather(dst []byte, frags [][]byte) {
	n := 0
	for _, f := range frags {
		if n == len(dst) {
			return
		}
		n += copy(dst[n:], f)
	}
}

// cursor reads big-endian fields; any read past the end marks it bad and
// returns zero values.
type cursor struct {
	b   []byte
	bad bool
}

func (c *cursor) bytes(n int) []byte {
	if c.bad || n > len(c.b) {
		c.bad = true
		return nil
	}
	v := c.b[:n]
	c.b = c.b[n:]
	return v
}

func (c *cursor) u8() int {
	v := c.bytes(1)
	if v == nil {
		return 0
	}
	return int(v[0])
}

func (c *cursor) u16() int {
	v := c.bytes(2)
	if v == nil {
		return 0
	}
	return int(v[0])<<8 | int(v[1])
}

func (c *cursor) vec8() []byte  { return c.bytes(c.u8()) }
func (c *cursor) vec16() []byte { return c.bytes(c.u16()) }

// parseClientHello parses a ClientHello body (RFC 8446 4.1.2, which also
// covers earlier versions) for its server_name and whether it carries
// encrypted_client_hello.
func parseClientHello(body []byte) (name string, ech bool, err error) {
	c := cursor{b: body}
	c.bytes(2 + 32) // legacy_version, random
	if sid := c.vec8(); len(sid) > 32 {
		return "", false, malformed("session id of %d bytes", len(sid))
	}
	if cs := c.vec16(); len(cs) < 2 || len(cs)%2 != 0 {
		return "", false, malformed("cipher suites")
	}
	if cm := c.vec8(); len(cm) < 1 {
		return "", false, malformed("compression methods")
	}
	if c.bad {
		return "", false, malformed("truncated ClientHello")
	}
	if len(c.b) == 0 {
		return "", false, nil // no extensions at all
	}
	exts := cursor{b: c.vec16()}
	if c.bad || len(c.b) != 0 {
		return "", false, malformed("extensions length")
	}
	var seen [1 << 16 / 64]uint64
	sni := ""
	for len(exts.b) > 0 {
		typ := exts.u16()
		data := exts.vec16()
		if exts.bad {
			return "", false, malformed("truncated extension")
		}
		if seen[typ/64]&(1<<(typ%64)) != 0 {
			return "", false, malformed("extension %#04x repeated", typ)
		}
		seen[typ/64] |= 1 << (typ % 64)
		switch typ {
		case extECH:
			ech = true
		case extServerName:
			n, err := parseServerName(data)
			if err != nil {
				return "", false, err
			}
			sni = n
		}
	}
	return sni, ech, nil
}

// parseServerName parses the server_name extension (RFC 6066 3): one
// host_name at most; other name types are skipped.
func parseServerName(data []byte) (string, error) {
	c := cursor{b: data}
	list := cursor{b: c.vec16()}
	if c.bad || len(c.b) != 0 || len(list.b) == 0 {
		return "", malformed("server_name extension")
	}
	var host []byte
	found := false
	for len(list.b) > 0 {
		typ := list.u8()
		v := list.vec16()
		if list.bad {
			return "", malformed("truncated server_name")
		}
		if typ != serverNameHostName {
			continue
		}
		if found {
			return "", ErrDuplicateSNI
		}
		host, found = v, true
	}
	if !found {
		return "", nil
	}
	name, ok := canonicalHost(string(host))
	if !ok {
		return "", fmt.Errorf("%w in SNI", ErrBadName)
	}
	return name, nil
}
