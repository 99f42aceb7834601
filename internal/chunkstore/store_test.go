package chunkstore

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

func TestPolynomialIrreducible(t *testing.T) {
	if !polynomial.Irreducible() {
		t.Fatalf("polynomial %v is not irreducible", polynomial)
	}
}

func TestRoundTrip(t *testing.T) {
	cases := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"one byte", []byte{42}},
		{"random", randomBytes(1, scale(12*miB)+123)},
		{"sparse", sparseBytes(2, scale(32*miB))},
		{"zeros", make([]byte, scale(20*miB))},
	}
	forBackends(t, func(t *testing.T, tb testBackend) {
		s := New(tb, Options{})
		for _, c := range cases {
			obj, st := put(t, s, c.data)
			commit(t, s, "cp-"+strings.ReplaceAll(c.name, " ", "-"), named("disk", obj))
			m, err := s.Open(context.Background(), "cp-"+strings.ReplaceAll(c.name, " ", "-"))
			if err != nil {
				t.Fatal(err)
			}
			if err := readBack(s, m.Objects[0], c.data); err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
			if st.Logical != int64(len(c.data)) || obj.Size != st.Logical {
				t.Fatalf("%s: logical %d, size %d, want %d", c.name, st.Logical, obj.Size, len(c.data))
			}
			t.Logf("%-14s logical %9d  chunks %3d  new chunks %3d  new logical %9d  stored %9d",
				c.name, st.Logical, st.Chunks, st.NewChunks, st.NewLogical, st.Stored)
		}
	})
}

func TestSparseAndZeroDataStoreLittle(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		s := New(tb, Options{})
		n := scale(32 * miB)
		_, st := put(t, s, make([]byte, n))
		if st.NewChunks != 1 || st.Stored > 64*kiB {
			t.Fatalf("%d bytes of zeros: %d new chunks, %d bytes stored; want 1 chunk, compressed", n, st.NewChunks, st.Stored)
		}
		_, st = put(t, s, sparseBytes(3, n))
		if st.Stored > 4*miB {
			t.Fatalf("%d bytes sparse (320 KiB of data): stored %d bytes", n, st.Stored)
		}
		t.Logf("sparse %d after zeros: %d new chunks, new logical %d, stored %d", n, st.NewChunks, st.NewLogical, st.Stored)

		raw := New(tb, Options{NoCompression: true})
		_, st = put(t, raw, bytes.Repeat([]byte{7}, 4*miB))
		if st.Stored != st.NewLogical+int64(st.NewChunks) {
			t.Fatalf("NoCompression: stored %d for %d new bytes in %d chunks", st.Stored, st.NewLogical, st.NewChunks)
		}
	})
}

func TestSecondPutStoresNothing(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		s := New(tb, Options{})
		data := randomBytes(4, scale(10*miB))
		first, st1 := put(t, s, data)
		second, st2 := put(t, s, data)
		if st2.NewChunks != 0 || st2.Stored != 0 || st2.NewLogical != 0 {
			t.Fatalf("second put stored %d chunks, %d bytes", st2.NewChunks, st2.Stored)
		}
		if st1.NewLogical != int64(len(data)) {
			t.Fatalf("first put: new logical %d, want %d", st1.NewLogical, len(data))
		}
		if len(first.Chunks) != len(second.Chunks) || keysOf(first)[0] != keysOf(second)[0] {
			t.Fatal("equal data, different chunks")
		}
		// A fresh Store on the same backend (a restarted server) dedups too.
		_, st3 := put(t, New(tb, Options{}), data)
		if st3.Stored != 0 {
			t.Fatalf("after restart: stored %d", st3.Stored)
		}
	})
}

// TestSmallChangeStoresFewChunks is the dedup a checkpoint of a barely
// changed disk relies on: a byte changed, or inserted, in the middle of 64
// MiB (8 under the race detector) stores a chunk or two, not the file.
func TestSmallChangeStoresFewChunks(t *testing.T) {
	tb := newDirTest(t) // the real backend; the chunking is the same on every one
	s := New(tb, Options{})
	n := scale(64 * miB)
	base := randomBytes(5, n)
	_, st0 := put(t, s, base)

	changed := bytes.Clone(base)
	changed[n/2] ^= 1
	objC, stC := put(t, s, changed)

	inserted := append(append(bytes.Clone(base[:n/2]), 'x'), base[n/2:]...)
	_, stI := put(t, s, inserted)

	t.Logf("%d bytes random: %d chunks, stored %d", n, st0.Chunks, st0.Stored)
	t.Logf("1 byte changed: %d new chunks, new logical %d (%.1f%%)", stC.NewChunks, stC.NewLogical,
		100*float64(stC.NewLogical)/float64(stC.Logical))
	t.Logf("1 byte inserted: %d new chunks, new logical %d (%.1f%%)", stI.NewChunks, stI.NewLogical,
		100*float64(stI.NewLogical)/float64(stI.Logical))
	for _, st := range []PutStats{stC, stI} {
		if st.NewChunks < 1 || st.NewChunks > 2 || st.NewLogical > 2*MaxChunk {
			t.Fatalf("a 1-byte change stored %d chunks, %d bytes", st.NewChunks, st.NewLogical)
		}
	}
	if err := readBack(s, objC, changed); err != nil {
		t.Fatalf("changed data did not read back: %v", err)
	}
}

// damage commits an object of several chunks, damages its third chunk with
// how, and returns what a reader of the committed object sees.
func damage(t *testing.T, tb testBackend, how func(t *testing.T, key string)) (data []byte, m Manifest, bad ChunkRef, got []byte, err error) {
	s := newSmall(tb, Options{})
	data = randomBytes(6, miB)
	obj, _ := put(t, s, data)
	if len(obj.Chunks) < 4 {
		t.Fatalf("only %d chunks", len(obj.Chunks))
	}
	commit(t, s, "sb1:cp1", named("memory", obj))
	bad = obj.Chunks[2]
	how(t, bad.ID.key())
	m, oerr := s.Open(context.Background(), "sb1:cp1")
	if oerr != nil {
		t.Fatal(oerr)
	}
	got, err = readAll(t, s, m.Objects[0])
	return data, m, bad, got, err
}

func checkChunkError(t *testing.T, err error, want error, bad ChunkRef, data, got []byte, m Manifest) {
	t.Helper()
	var ce *ChunkError
	if !errors.As(err, &ce) {
		t.Fatalf("read: %v, want a *ChunkError", err)
	}
	if !errors.Is(err, want) || !errors.Is(err, errdefs.ErrUnprocessable) {
		t.Fatalf("read: %v, want %v and errdefs.ErrUnprocessable", err, want)
	}
	if ce.Manifest != "sb1:cp1" || ce.Object != "memory" || ce.Chunk != bad.ID || ce.Index != 2 {
		t.Fatalf("error names %q %q chunk %d %s", ce.Manifest, ce.Object, ce.Index, ce.Chunk)
	}
	msg := err.Error()
	if !strings.Contains(msg, `"sb1:cp1"`) || !strings.Contains(msg, bad.ID.String()) {
		t.Fatalf("message %q does not name the manifest and the chunk", msg)
	}
	// Everything before the bad chunk was returned, nothing of it.
	off := m.Objects[0].Chunks[0].Size + m.Objects[0].Chunks[1].Size
	if int64(off) != ce.Offset || !bytes.Equal(got, data[:off]) {
		t.Fatalf("read %d bytes before failing, want the %d before the bad chunk", len(got), off)
	}
	t.Logf("%v", err)
}

func TestCorruptChunkFailsNamingIt(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		data, m, bad, got, err := damage(t, tb, tb.corrupt)
		checkChunkError(t, err, ErrCorrupt, bad, data, got, m)
	})
}

func TestMissingChunkFailsNamingIt(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		data, m, bad, got, err := damage(t, tb, tb.remove)
		checkChunkError(t, err, ErrMissing, bad, data, got, m)
	})
}

func TestCorruptCompressedChunk(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		s := newSmall(tb, Options{})
		data := bytes.Repeat([]byte("compressible text, "), 20*kiB)
		obj, st := put(t, s, data)
		if st.Stored*2 > st.Logical {
			t.Fatalf("not compressed: %d of %d", st.Stored, st.Logical)
		}
		tb.corrupt(t, obj.Chunks[0].ID.key())
		_, err := readAll(t, s, obj)
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "uncommitted object") {
			t.Fatalf("read: %v", err)
		}
	})
}

func TestBadInputsRefused(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		ctx := context.Background()
		s := newSmall(tb, Options{})
		obj, _ := put(t, s, randomBytes(7, 512*kiB))
		good := named("disk", obj)

		for _, name := range []string{"", "a/b", "..", "../x", ".", ".hidden", "a b", "a\x00b", "a\\b",
			".tmp-1", strings.Repeat("x", 201)} {
			if err := s.Commit(ctx, name, Manifest{Objects: []Object{good}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Commit(%q): %v, want ErrInvalidArgument", name, err)
			}
			if _, err := s.Open(ctx, name); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Open(%q): %v, want ErrInvalidArgument", name, err)
			}
			if err := s.Delete(ctx, name); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Delete(%q): %v, want ErrInvalidArgument", name, err)
			}
		}

		short := good
		short.Size--
		zero := good
		zero.Chunks = append([]ChunkRef{{ID: good.Chunks[0].ID}}, good.Chunks...)
		for name, objs := range map[string][]Object{
			"unnamed":     {obj},
			"twice":       {good, good},
			"size":        {short},
			"empty chunk": {zero},
			"huge chunk":  {{Name: "x", Size: MaxChunk + 1, Chunks: []ChunkRef{{ID: good.Chunks[0].ID, Size: MaxChunk + 1}}}},
			"negative":    {{Name: "x", Size: -1}},
		} {
			if err := s.Commit(ctx, "bad", Manifest{Objects: objs}); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("%s: Commit: %v, want ErrInvalidArgument", name, err)
			}
		}

		// A chunk that was never stored: refused, and nothing is visible.
		ghost := Object{Name: "ghost", Size: 5, Chunks: []ChunkRef{{ID: ID{1, 2, 3}, Size: 5}}}
		err := s.Commit(ctx, "ghost", Manifest{Objects: []Object{good, ghost}})
		var ce *ChunkError
		if !errors.Is(err, ErrMissing) || !errors.As(err, &ce) || ce.Object != "ghost" || ce.Manifest != "ghost" {
			t.Fatalf("Commit naming a missing chunk: %v", err)
		}
		if names, _ := s.List(ctx); len(names) != 0 {
			t.Fatalf("visible after failed commits: %v", names)
		}

		commit(t, s, "ok", good)
		if err := s.Commit(ctx, "ok", Manifest{Objects: []Object{good}}); !errors.Is(err, errdefs.ErrConflict) {
			t.Fatalf("second Commit of a name: %v, want ErrConflict", err)
		}
		if _, err := s.Open(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("Open of a missing manifest: %v", err)
		}
		if err := s.Delete(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("Delete of a missing manifest: %v", err)
		}
		if err := s.Delete(ctx, "ok"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Open(ctx, "ok"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("Open after Delete: %v", err)
		}
	})
}

func TestCorruptManifest(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		ctx := context.Background()
		s := newSmall(tb, Options{})
		obj, _ := put(t, s, randomBytes(8, 384*kiB))
		commit(t, s, "cp", named("disk", obj))
		tb.corrupt(t, manifestKey("cp"))
		if _, err := s.Open(ctx, "cp"); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `"cp"`) {
			t.Fatalf("Open of a damaged manifest: %v", err)
		}
		// GC cannot know what it references, so it deletes nothing.
		if _, err := tb.PutIfAbsent(ctx, manifestKey("other"), []byte(`{"format":1,"name":"cp"}`)); err != nil {
			t.Fatal(err)
		}
		before := chunkKeys(t, tb)
		if _, err := s.GC(ctx); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("GC with a damaged manifest: %v", err)
		}
		if after := chunkKeys(t, tb); len(after) != len(before) {
			t.Fatalf("GC deleted %d chunks despite an unreadable manifest", len(before)-len(after))
		}
	})
}

func TestManifestMetaAndList(t *testing.T) {
	forBackends(t, func(t *testing.T, tb testBackend) {
		ctx := context.Background()
		s := newSmall(tb, Options{})
		disk, _ := put(t, s, randomBytes(9, 256*kiB))
		mem, _ := put(t, s, sparseBytes(10, 512*kiB))
		disk.Name, disk.Meta = "disk", map[string]string{"fs": "ext4"}
		mem.Name = "memory"
		for _, n := range []string{"b:2", "a:1", "c@3"} {
			if err := s.Commit(ctx, n, Manifest{Meta: map[string]string{"kind": "full"}, Objects: []Object{disk, mem}}); err != nil {
				t.Fatal(err)
			}
		}
		names, err := s.List(ctx)
		if err != nil || strings.Join(names, ",") != "a:1,b:2,c@3" {
			t.Fatalf("List: %v %v", names, err)
		}
		m, err := s.Open(ctx, "b:2")
		if err != nil {
			t.Fatal(err)
		}
		o, ok := m.Object("disk")
		if m.Meta["kind"] != "full" || !ok || o.Meta["fs"] != "ext4" || m.Created.IsZero() || m.Name != "b:2" {
			t.Fatalf("manifest read back as %+v", m)
		}
	})
}

func TestDirSurvivesRestart(t *testing.T) {
	tb := newDirTest(t)
	data := randomBytes(11, 512*kiB)
	obj, _ := put(t, newSmall(tb, Options{}), data)
	commit(t, newSmall(tb, Options{}), "cp", named("disk", obj))

	d, err := NewDir(tb.dir.root) // the server restarted
	if err != nil {
		t.Fatal(err)
	}
	s := New(d, Options{})
	m, err := s.Open(context.Background(), "cp")
	if err != nil {
		t.Fatal(err)
	}
	if err := readBack(s, m.Objects[0], data); err != nil {
		t.Fatalf("after restart: %v", err)
	}
}
