package cli

import (
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"

	"github.com/spf13/cobra"

	"github.com/spacehq/space/api"
)

func newPortCmd(a *app) *cobra.Command {
	var public, private bool
	cmd := &cobra.Command{
		Use:   "port ID PORT",
		Short: "Print URLs that reach a service listening on PORT in a sandbox, through the server",
		Long: `Print the host-routed URL (with the sandbox's access token) and the
path-routed URL of a service listening on PORT inside the sandbox. The
service must listen on 0.0.0.0, not only 127.0.0.1. A request wakes a
paused, stopped or suspended sandbox. --public makes the port reachable
without the token; --private takes that back.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if public && private {
				return usagef("--public and --private exclude each other")
			}
			port, err := parsePortArg(args[1])
			if err != nil {
				return err
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			var pi *api.PortInfo
			if public || private {
				pi, err = c.SetPortPublic(a.ctx, args[0], port, public)
			} else {
				pi, err = c.Port(a.ctx, args[0], port)
			}
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.out, pi)
			}
			if pi.Public {
				fmt.Fprintf(a.out, "%s\n", pi.URL)
				fmt.Fprintf(a.out, "path-routed: %s\npublic: no token needed\n", pi.PathURL)
				return nil
			}
			fmt.Fprintf(a.out, "%s?%s=%s\n", pi.URL, api.PortTokenQuery, pi.Token)
			fmt.Fprintf(a.out, "path-routed: %s\ntoken: %s (header %s, or ?%s=)\n", pi.PathURL, pi.Token, api.PortTokenHeader, api.PortTokenQuery)
			return nil
		},
	}
	cmd.Flags().BoolVar(&public, "public", false, "make the port reachable without the access token")
	cmd.Flags().BoolVar(&private, "private", false, "require the access token again")
	return cmd
}

func parsePortArg(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, usagef("port must be a number 1..65535, got %q", s)
	}
	return n, nil
}

func newPortForwardCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "port-forward ID LOCAL:REMOTE",
		Short: "Forward 127.0.0.1:LOCAL to port REMOTE of a sandbox (raw TCP)",
		Long: `Listen on 127.0.0.1:LOCAL (0 picks a free port) and carry every accepted
connection to port REMOTE inside the sandbox, as raw TCP tunnelled over a
WebSocket through the server. Runs until interrupted.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, r, ok := strings.Cut(args[1], ":")
			if !ok {
				return usagef("want LOCAL:REMOTE, got %q", args[1])
			}
			local, err := strconv.Atoi(l)
			if err != nil || local < 0 || local > 65535 {
				return usagef("local port must be 0..65535, got %q", l)
			}
			remote, err := parsePortArg(r)
			if err != nil {
				return err
			}
			c, err := a.Client()
			if err != nil {
				return err
			}
			id := args[0]
			// Fail early (unknown sandbox, no key) rather than on the
			// first connection.
			if _, err := c.Port(a.ctx, id, remote); err != nil {
				return err
			}
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(local)))
			if err != nil {
				return err
			}
			defer ln.Close()
			fmt.Fprintf(a.errOut, "forwarding %s -> %s:%d (Ctrl-C to stop)\n", ln.Addr(), id, remote)
			go func() {
				<-a.ctx.Done()
				ln.Close()
			}()
			var wg sync.WaitGroup
			defer wg.Wait()
			for {
				lc, err := ln.Accept()
				if err != nil {
					if a.ctx.Err() != nil {
						return nil
					}
					return err
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer lc.Close()
					rc, err := c.DialPort(a.ctx, id, remote)
					if err != nil {
						fmt.Fprintf(a.errOut, "port-forward: %v\n", err)
						return
					}
					defer rc.Close()
					stop := make(chan struct{})
					go func() {
						select {
						case <-a.ctx.Done():
							lc.Close()
							rc.Close()
						case <-stop:
						}
					}()
					defer close(stop)
					copyBoth(lc, rc)
				}()
			}
		},
	}
}

// copyBoth copies a and b into each other, passing the end of each
// direction on as a half-close, until both have ended.
func copyBoth(a, b net.Conn) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(b, a)
		closeWrite(b)
		close(done)
	}()
	_, _ = io.Copy(a, b)
	closeWrite(a)
	<-done
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}
